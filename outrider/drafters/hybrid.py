"""`--drafter hybrid:[K,]DRAFTER`: suffix decoding where the text repeats itself, DRAFTER elsewhere.

Suffix decoding (suffix.py) drafts long runs for almost nothing where the output repeats what
came before (code being edited, tool-call arguments echoing the prompt) and nothing where it does
not; a model drafter (an EAGLE-3 head, a draft model) drafts a token or two everywhere at the cost
of forwards. Each round, for each sequence, the hybrid asks the suffix drafter first: when its
best speculation's score (the tokens it expects accepted if its counts were the truth, the sum of
its node scores) reaches the threshold, that tree is proposed; otherwise DRAFTER's, drafted at
most K deep (K: the round's depth when omitted). The threshold is MIN_SCORE (2 tokens), or the
tokens DRAFTER's own proposals have had accepted lately when that is more (a running mean over
the rounds it proposed), so beside a strong drafter (a draft model accepted 5 tokens a round) the
suffix trees take only the rounds they would win. So `--drafter hybrid:2,eagle3:smollm2-135m-instruct
--controller fixed:6` drafts 6 deep from the suffix trees and a chain of 2 from the head.

Both drafters follow every committed token, whichever proposed: the suffix trees take each
commit; a model drafter whose proposal was skipped feeds the commit at its next catch-up (a draft
model's cache, an EAGLE-3 head's pending features: each already handles a round in which it
proposed nothing). A DRAFTER that reads the target's own cache (early exit) is refused.

What it declares: every `--tree` kind DRAFTER builds, as trees without draft probabilities (a
suffix tree has none, so the verifier never needs them: greedy decoding takes the greedy tree
verifier, sampling the tree walk, exact for any drafts chosen apart from the verifier's random
draws), and the hidden-state layers DRAFTER reads. Measured:
docs/benchmarks/2026-11-30-intel-xeon-avx512-amx.md, "EAGLE-3 preset" and "Draft model: the Qwen pair".
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..errors import ConfigError
from ..sampling import SamplingParams
from ..spec.shapes import TreeShape
from ..spec.types import Budget, DraftTree, VerifyResult
from .base import DrafterBase
from .capabilities import Capabilities, Drafts
from .registry import DrafterEntry, parse_drafter, register
from .suffix import SuffixDrafter

MIN_SCORE = 2.0  # a suffix speculation expecting this many accepted tokens beats the model drafter
RATE = 0.1  # weight of each round in the running mean of the other drafter's accepted tokens
TREES = {kind: Drafts("tree") for kind in ("chain", "static", "dynamic")}


@dataclass(frozen=True)
class HybridArgument:
    text: str  # DRAFTER as given
    entry: DrafterEntry
    argument: object  # DRAFTER's own, parsed
    depth: int | None  # K: DRAFTER's deepest draft (None: the round's depth)

    def __str__(self) -> str:
        return self.text if self.depth is None else f"{self.depth},{self.text}"


def parse_argument(text: str) -> HybridArgument:
    head, comma, rest = text.partition(",")
    depth = None
    if comma and head.strip().isdigit():
        depth, text = int(head), rest
        if depth < 1:
            raise ConfigError("K (the other drafter's depth) must be >= 1, as in hybrid:2,eagle3:NAME")
    if not text:
        raise ConfigError("name the drafter to use where suffix decoding is not confident, "
                          "as in hybrid:eagle3:NAME or hybrid:2,draft-model:NAME")
    entry, argument = parse_drafter(text)
    if entry.name in ("hybrid", "suffix"):
        raise ConfigError(f"the other drafter of a hybrid cannot be {entry.name}; use a model drafter "
                          "(eagle3:NAME, draft-model:NAME) or ngram")
    return HybridArgument(text, entry, argument, depth)


class HybridDrafter(DrafterBase):
    """Suffix trees where they are confident, another drafter's proposals elsewhere."""

    capabilities = Capabilities(trees=TREES)

    def __init__(self, suffix: SuffixDrafter, other, other_name: str, depth: int | None = None,
                 min_score: float = MIN_SCORE):
        if other.capabilities.reads_target_cache:
            raise ConfigError(f"--drafter hybrid:{other_name}: a drafter over the target's own cache cannot skip "
                              "rounds; use eagle3:NAME or draft-model:NAME")
        self.suffix = suffix
        self.other = other
        self.depth = depth
        self.min_score = min_score
        self.name = f"hybrid:{other_name}" if depth is None else f"hybrid:{depth},{other_name}"
        self.capabilities = replace(type(self).capabilities, needs_hidden=other.capabilities.needs_hidden)
        self.suffix_rounds = 0  # proposals taken from the suffix trees (the rest: the other drafter's)
        self.other_rounds = 0
        self.other_accepted = min_score  # running mean of the tokens the other drafter's proposals had accepted
        self._by_other: set[int] = set()  # sequences whose latest proposal was the other drafter's

    @property
    def threshold(self) -> float:
        """The suffix score from which the suffix trees propose."""
        return max(self.min_score, self.other_accepted)

    def _other_budget(self, budget: Budget) -> Budget:
        return budget if self.depth is None else replace(budget, depth=min(budget.depth, self.depth))

    def max_nodes(self, depth: int) -> int:
        other_depth = depth if self.depth is None else min(depth, self.depth)
        return max(self.suffix.max_nodes(depth), self.other.max_nodes(other_depth))

    def start(self, seq_id: int, prompt: list[int], params: SamplingParams | None = None, **extra) -> None:
        """`extra` (the prompt's hidden states for a head) goes to the other drafter."""
        self.suffix.start(seq_id, prompt, params)
        self.other.start(seq_id, prompt, params, **extra)

    def propose(self, seq_id: int, tokens: list[int], budget: Budget) -> DraftTree:
        return self.propose_batch([seq_id], [tokens], [budget])[0]

    def propose_batch(self, seq_ids: list[int], tokens: list[list[int]], budgets: list[Budget]) -> list[DraftTree]:
        trees: list[DraftTree | None] = []
        rest = []  # sequences the suffix trees are not confident for
        threshold = self.threshold
        for i, (seq_id, toks, budget) in enumerate(zip(seq_ids, tokens, budgets)):
            tree, score = self.suffix.scored_proposal(seq_id, toks, budget)
            trees.append(tree if score >= threshold else None)
            if trees[-1] is None:
                rest.append(i)
                self._by_other.add(seq_id)
            else:
                self._by_other.discard(seq_id)
        self.suffix_rounds += len(seq_ids) - len(rest)
        self.other_rounds += len(rest)
        if rest:
            others = self.other.propose_batch([seq_ids[i] for i in rest], [tokens[i] for i in rest],
                                              [self._other_budget(budgets[i]) for i in rest])
            for i, tree in zip(rest, others):
                trees[i] = DraftTree(tree.tokens, tree.parents, confidence=tree.confidence)  # no q: module notes
        return trees

    def update(self, seq_id: int, result: VerifyResult, hidden: torch.Tensor | None = None) -> None:
        self.update_batch([seq_id], [result], [hidden])

    def update_batch(self, seq_ids: list[int], results: list[VerifyResult], hidden: list) -> None:
        for seq_id, result in zip(seq_ids, results):
            self.suffix.update(seq_id, result)
            if seq_id in self._by_other:
                self.other_accepted += RATE * (result.num_accepted - self.other_accepted)
        self.other.update_batch(seq_ids, results, hidden)

    def finish(self, seq_id: int, tokens: list[int]) -> None:
        self._by_other.discard(seq_id)
        self.suffix.finish(seq_id, tokens)
        self.other.finish(seq_id, tokens)


def build(arg: HybridArgument, shape: TreeShape, target, target_path: Path) -> HybridDrafter:
    if not arg.entry.capabilities.builds(shape.kind):
        raise ConfigError(f"--tree {shape.kind} does not fit --drafter hybrid:{arg}: {arg.entry.name} builds only "
                          f"--tree {' or '.join(arg.entry.capabilities.trees)}; use that, or a model drafter")
    other = arg.entry.build(arg.argument, shape, target, target_path)
    return HybridDrafter(SuffixDrafter(), other, arg.text, arg.depth)


register(DrafterEntry(
    "hybrid", "hybrid:[K,]DRAFTER", HybridDrafter.capabilities, build=build, parse_argument=parse_argument,
    models_needed=lambda arg: arg.entry.models_needed(arg.argument),
    check_fits=lambda arg, config, path: arg.entry.check_fits(arg.argument, config, path)))
