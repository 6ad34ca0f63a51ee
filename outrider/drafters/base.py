"""The drafter protocol: every hook the engine calls, and `DrafterBase` with their defaults.

A drafter proposes a `DraftTree` per sequence and then follows the committed prefix. It never
changes what is committed: the verifier decides that, exactly. Drafters keep their own state
(an index over the text so far, a draft model's KV cache) and roll it to the committed prefix
after each round.

The round (engine/round.py) calls the drafter once for the whole batch: `propose_batch`, then
`update_batch` (after `observe_attention`, for a drafter that reads the verify forward's scores).
A drafter that gains from batching (a model drafter: one forward per draft depth for all
sequences) overrides them; any other (n-gram, suffix) writes only the per-sequence `propose` and
`update`, and `DrafterBase`'s defaults call them in turn. Around the rounds, the speculator
(engine/speculator.py) calls `attach_target_cache` once per engine, `start` as each sequence's
prompt is in the cache and `finish` when it ends.

A drafter is registered by name (registry.py) with the capabilities it declares
(capabilities.py); the engine chooses the verifier, the hidden-state taps, the keywords `start`
gets and the optional hooks it calls from those, never from the drafter's name or type, and never
by looking for methods: a drafter has every hook of `Drafter` (subclass `DrafterBase` for the
defaults; `Speculator` refuses one that lacks a hook it would call).
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..sampling import SamplingParams
from ..spec.types import Budget, DraftTree, VerifyResult
from .capabilities import Capabilities


class Drafter(Protocol):
    name: str
    capabilities: Capabilities  # what it builds and what its drafts are (capabilities.py)

    def max_nodes(self, depth: int) -> int:
        """The most draft nodes (root excluded) a proposal of this depth may hold."""

    def start(self, seq_id: int, prompt: list[int], params: SamplingParams | None = None, *,
              target_slot: int | None = None, hidden: torch.Tensor | None = None, coupled: bool = False) -> None:
        """A new sequence whose committed tokens so far are `prompt`, sampled with `params`. The
        keywords come only where the capabilities ask for them, so a drafter that declares none
        may take (seq_id, prompt, params) alone:
        target_slot: the sequence's slot in the target's cache (`reads_target_cache`);
        hidden: the prompt's hidden states at the declared layers, [len(prompt) - 1,
            len(needs_hidden), E], or None for a one-token prompt (`needs_hidden`);
        coupled: True where the drafter `couples` and the sequence's verifier is a walk: draw the
            sampled chain with the verifier's own token uniforms (capabilities.py)."""

    def propose(self, seq_id: int, tokens: list[int], budget: Budget) -> DraftTree:
        """A tree rooted at tokens[-1] (the last committed token) within `budget`."""

    def propose_batch(self, seq_ids: list[int], tokens: list[list[int]], budgets: list[Budget]) -> list[DraftTree]:
        """One tree per sequence (tokens[b]: its committed tokens), in one call for the round."""

    def update(self, seq_id: int, result: VerifyResult, hidden: torch.Tensor | None = None) -> None:
        """The round committed `result.tokens`; follow the committed prefix. `hidden`: for a
        drafter whose capabilities declare `needs_hidden` layers, the target's hidden states of
        those layers at the accepted path's positions ([a + 1, len(needs_hidden), E], from the
        verify forward: no extra target pass); None otherwise."""

    def update_batch(self, seq_ids: list[int], results: list[VerifyResult],
                     hidden: list[torch.Tensor | None]) -> None:
        """The round committed results[b] for seq_ids[b]; hidden[b]: its taps on the accepted path
        or None. Raising fails every sequence of the call, except a `SequenceFaults`, which names
        the sequences it concerns."""

    def observe_attention(self, seq_ids: list[int], attention: list[torch.Tensor | None]) -> None:
        """Called before the round's update, only for a drafter that declares `needs_attention`:
        each sequence's verify-forward scores [layers, G, kv_len], or None where the forward
        cannot give them (not the native layer)."""

    def attach_target_cache(self, cache) -> None:
        """Called once per engine, before its first sequence starts, only for a drafter that
        declares `reads_target_cache`: the target's slot state, to draft over."""

    def finish(self, seq_id: int, tokens: list[int]) -> None:
        """The sequence ended with these committed tokens (prompt + output)."""


# the hooks the engine calls whatever a drafter declares; observe_attention and
# attach_target_cache only where `needs_attention` and `reads_target_cache` are declared
HOOKS = ("max_nodes", "start", "propose_batch", "update_batch", "finish")


class SequenceFaults(Exception):
    """What `update_batch` raises when some sequences' updates raised and the others' went
    through: faults[b] is the exception of seq_ids[b]."""

    def __init__(self, faults: dict[int, Exception]):
        super().__init__("; ".join(f"sequence {b}: {type(e).__name__}: {e}" for b, e in faults.items()))
        self.faults = faults


class DrafterBase:
    """The defaults of the hooks a drafter need not write: the batch hooks call the per-sequence
    ones in turn, a sequence is started and finished with nothing to keep, and the hooks behind a
    capability refuse (a drafter that declares the capability writes its own; the speculator
    refuses, when it is built, one that declares it and keeps the refusal)."""

    def start(self, seq_id: int, prompt: list[int], params: SamplingParams | None = None, **declared) -> None:
        """Keeps nothing (a drafter with state per sequence overrides it)."""

    def propose_batch(self, seq_ids: list[int], tokens: list[list[int]], budgets: list[Budget]) -> list[DraftTree]:
        """`propose` for each sequence in turn."""
        return [self.propose(s, t, b) for s, t, b in zip(seq_ids, tokens, budgets)]

    def update(self, seq_id: int, result: VerifyResult, hidden: torch.Tensor | None = None) -> None:
        """Follows nothing (a drafter with state per sequence overrides it)."""

    def update_batch(self, seq_ids: list[int], results: list[VerifyResult],
                     hidden: list[torch.Tensor | None]) -> None:
        """`update` for each sequence in turn; the sequences whose update raised are named in
        one `SequenceFaults` at the end (the others were followed)."""
        faults = {}
        for b, (s, r, h) in enumerate(zip(seq_ids, results, hidden)):
            try:
                self.update(s, r, h)
            except Exception as err:  # noqa: PERF203  (this sequence's state broke, not the others')
                faults[b] = err
        if faults:
            raise SequenceFaults(faults)

    def observe_attention(self, seq_ids: list[int], attention: list[torch.Tensor | None]) -> None:
        raise NotImplementedError(f"{type(self).__name__} declares needs_attention: it must define observe_attention")

    def attach_target_cache(self, cache) -> None:
        raise NotImplementedError(f"{type(self).__name__} declares reads_target_cache: it must define "
                                  "attach_target_cache")

    def finish(self, seq_id: int, tokens: list[int]) -> None:
        """Forgets nothing (a drafter with state per sequence overrides it)."""


def missing_hooks(drafter, capabilities: Capabilities) -> list[str]:
    """The hooks the engine would call on `drafter` (those of HOOKS, and the ones its
    capabilities ask for) that it does not have, DrafterBase's refusals counted as missing."""
    declared = ("observe_attention",) * capabilities.needs_attention \
        + ("attach_target_cache",) * capabilities.reads_target_cache
    return [hook for hook in HOOKS + declared if not callable(getattr(drafter, hook, None))
            or (hook in declared and getattr(type(drafter), hook, None) is getattr(DrafterBase, hook))]


def missing_tail(known: list[int], tokens: list[int]) -> list[int] | None:
    """What a drafter that has seen `known` must append to follow `tokens` (the committed prefix).

    [] when it is in step, the missing tail when it is behind, None when it must rebuild. Only the
    lengths and one token are compared (O(1)): the engine only ever extends the committed prefix
    it told the drafter about through start/update.
    """
    n = len(known)
    if n == len(tokens) and n and tokens[-1] == known[-1]:
        return []
    if 0 < n < len(tokens) and tokens[n - 1] == known[-1]:
        return tokens[n:]
    return None


def catch_up(state, tokens: list[int], append) -> bool:
    """Bring a drafter's per-sequence `state` (which has `.tokens`) level with `tokens`, the
    committed prefix: True when it was in step or behind (`append(state, tail)` extends it), False
    when it must be rebuilt (no state, or another prefix: see `missing_tail`)."""
    tail = missing_tail(state.tokens, tokens) if state is not None else None
    if tail is None:
        return False
    if tail:
        append(state, tail)
    return True


def ancestors_kept(cand: list[tuple[int, int, float]], c: int, kept: set[int]) -> bool:
    """Best-first trees: whether every ancestor of candidate `c` below the root is in `kept`.
    cand[i] = (token, parent candidate id, score); candidate 0 is the root."""
    p = cand[c][1]
    while p > 0:
        if p not in kept:
            return False
        p = cand[p][1]
    return True
