"""Verifier skipping: `--verifier verify-skip-lossy:T[,G]` (LOSSY; docs/methods.md#verifier-skipping).

The seed paper (verifier skipping for speculative diffusion decoding, seed-methods card 2.10)
lets a block drafter commit a contiguous high-confidence prefix of its block WITHOUT calling the
verifier, then draft again from there; the verifier runs only on a block whose first token is not
confident. The committed tokens are then no longer the target's: this is lossy by design, and
here it is named so, off by default, chosen only by its name and never by the lossless tests.

In Outrider a round is one verify forward, so the skip is folded into the round that follows it:
the drafter drafts a chain deeper than the verified block (`--controller fixed:D`), and this
verifier

    1. reads each draft's raw confidence, r_i = confidence[i] / confidence[i-1] (the drafter's
       probability of the token it drafted at position i: tree.confidence is the path product);
    2. commits the longest prefix d_1..d_m with every r_i >= T without looking at the target
       (the skipped blocks: each is a verifier call the paper's loop does not make);
    3. verifies greedily the next G drafts d_{m+1}..d_{m+G} (the paper's strict block), and
       commits the target's argmax after the last accepted one.

For a drafter that drafts its chain autoregressively (a draft model, EAGLE-3), drafting again from
d_1..d_m gives the very tokens d_{m+1}.. it drafted past them, so one round here makes exactly the
paper's sequence of skips and one verified block with one verifier call. (A DFlash block drafts
its positions independently: past the skipped prefix it is verified as drafted, not re-drafted
from the prefix.) The skip is capped by the chain's depth: D - G leaves room for the block.

With T > 1 nothing is skipped and the round is greedy verification of the first G drafts: the
target's greedy tokens, exactly (the tests hold that, and hold the name to its `-lossy`).
Greedy only (temperature 0), chains only. `rounds` logs each call for the measurement script
(scripts/verify_skip.py): the raw confidences, the skipped length, how many of the verified block
the target accepted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import ConfigError
from ..sampling import SamplingParams
from .types import DraftTree, VerifyResult

NAME = "verify-skip-lossy"
DEFAULT_THRESHOLD = 0.9
DEFAULT_BLOCK = 4


@dataclass
class SkipRound:
    raw: list[float]  # each draft's raw confidence r_i, in chain order
    skipped: int  # drafts committed unverified (m)
    checked: int  # drafts of the verified block (<= G)
    accepted: int  # of those, accepted by the target


def raw_confidence(tree: DraftTree) -> list[float]:
    """[k] each draft's own probability under the drafter: the ratio of consecutive path
    confidences (1.0 for every draft when the tree carries none)."""
    if tree.confidence is None:
        return [1.0] * (tree.size - 1)
    conf = tree.confidence.double().tolist()
    return [conf[i] / conf[i - 1] if conf[i - 1] > 0 else 0.0 for i in range(1, len(conf))]


def skip_length(raw: list[float], threshold: float, limit: int) -> int:
    """The longest prefix of at most `limit` drafts whose raw confidences are all >= threshold."""
    m = 0
    while m < min(limit, len(raw)) and raw[m] >= threshold:
        m += 1
    return m


@dataclass
class SkipVerifier:
    """LOSSY: commits the confident prefix unverified, then verifies a block of G (module notes)."""

    threshold: float = DEFAULT_THRESHOLD
    block: int = DEFAULT_BLOCK
    lossy: bool = True
    rounds: list[SkipRound] = field(default_factory=list, repr=False)

    def __call__(self, tree: DraftTree, target_logits: torch.Tensor, params: SamplingParams | None = None,
                 rng: object = None) -> VerifyResult:
        """tree: a chain; target_logits: [n, vocab] the target's logits at its nodes."""
        tokens = tree.tokens.tolist()
        k = len(tokens) - 1
        raw = raw_confidence(tree)
        m = skip_length(raw, self.threshold, max(0, k - self.block))
        last = min(k, m + self.block)
        choice = target_logits[m: last + 1].argmax(-1).tolist()  # the target's token after nodes m..last
        node = m
        while node < last and tokens[node + 1] == choice[node - m]:
            node += 1
        self.rounds.append(SkipRound(raw, m, last - m, node - m))
        accepted = list(range(1, node + 1))
        return VerifyResult(accepted, tokens[1: node + 1] + [choice[node - m]])


def verify_skip_reference(tree: DraftTree, target_logits: torch.Tensor, threshold: float, block: int) -> VerifyResult:
    """The same decision written out node by node, for the tests."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    assert parents == list(range(-1, len(tokens) - 1)), "a chain"
    conf = tree.confidence.tolist() if tree.confidence is not None else [1.0] * len(tokens)
    accepted, node = [], 0
    while node + 1 < len(tokens) and node + 1 <= len(tokens) - 1 - block and conf[node + 1] >= threshold * conf[node] > 0:
        node += 1
        accepted.append(node)
    stop = min(len(tokens) - 1, node + block)
    while node < stop and int(target_logits[node].argmax()) == tokens[node + 1]:
        node += 1
        accepted.append(node)
    return VerifyResult(accepted, [tokens[i] for i in accepted] + [int(target_logits[node].argmax())])


def parse_skip(argument: str) -> SkipVerifier:
    """`T[,G]`: the confidence threshold T (> 1: never skip) and the verified block G (default 4)."""
    if not argument:
        return SkipVerifier()
    parts = argument.split(",")
    try:
        threshold = float(parts[0])
        block = int(parts[1]) if len(parts) > 1 else DEFAULT_BLOCK
    except ValueError:
        raise ConfigError(f"{NAME}:T[,G] takes a confidence threshold T and a block size G, got {argument!r}") from None
    if len(parts) > 2 or not threshold >= 0 or not 1 <= block <= 64:
        raise ConfigError(f"{NAME}:T[,G] takes a threshold T >= 0 (> 1: never skip) and a block 1 <= G <= 64, "
                          f"got {argument!r}")
    return SkipVerifier(threshold, block)
