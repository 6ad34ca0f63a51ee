"""The drafter protocol.

A drafter proposes a `DraftTree` per sequence and then follows the committed prefix. It never
changes what is committed: the verifier decides that, exactly. Drafters keep their own state
(an index over the text so far, a draft model's KV cache) and `update` rolls it to the committed
prefix after each round.

The round calls the drafter once for the whole batch: `propose_batch` / `update_batch` below.
A drafter that gains from batching (a model drafter: one forward per draft depth for all
sequences) defines methods of those names; any other (n-gram, suffix) writes only the
per-sequence `propose` / `update`, and these defaults call them in turn.

A drafter is registered by name (registry.py) with the capabilities it declares
(capabilities.py); the engine chooses the verifier and the hidden-state taps from those, never
from the drafter's name or type.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from ..sampling import SamplingParams
from ..spec.types import DraftTree, VerifyResult
from .capabilities import Capabilities


@dataclass(frozen=True)
class Budget:
    """How much to draft this round: at most `depth` tokens deep and `nodes` drafts in all.

    A drafter with confidences may stop a path early once its probability (the product of the
    draft probabilities along it) falls below `min_confidence`. A model drafter drafting a chain
    calls `stop(entropies)` after each draft, with the entropies (nats) of the distributions the
    drafts so far came from, and drafts no deeper once it says True (`--controller entropy`,
    control/entropy.py); other drafters and trees ignore it.
    """

    depth: int
    nodes: int
    min_confidence: float = 0.0
    stop: Callable[[list[float]], bool] | None = None


class Drafter(Protocol):
    name: str
    capabilities: Capabilities  # what it builds and what its drafts are (capabilities.py)

    def max_nodes(self, depth: int) -> int:
        """The most draft nodes (root excluded) a proposal of this depth may hold."""

    def start(self, seq_id: int, prompt: list[int], params: SamplingParams | None = None) -> None:
        """A new sequence whose committed tokens so far are `prompt`, sampled with `params`."""

    def propose(self, seq_id: int, tokens: list[int], budget: Budget) -> DraftTree:
        """A tree rooted at tokens[-1] (the last committed token) within `budget`."""

    def update(self, seq_id: int, result: VerifyResult, hidden: torch.Tensor | None = None) -> None:
        """The round committed `result.tokens`; follow the committed prefix. `hidden`: for a
        drafter whose capabilities declare `needs_hidden` layers, the target's hidden states of
        those layers at the accepted path's positions ([a + 1, len(needs_hidden), E], from the
        verify forward: no extra target pass); None otherwise."""

    def finish(self, seq_id: int, tokens: list[int]) -> None:
        """The sequence ended with these committed tokens (prompt + output)."""


def propose_batch(drafter: Drafter, seq_ids: list[int], tokens: list[list[int]],
                  budgets: list[Budget]) -> list[DraftTree]:
    """One tree per sequence (tokens[b]: its committed tokens), in one call for the round."""
    batched = getattr(drafter, "propose_batch", None)
    if batched is not None:
        return batched(seq_ids, tokens, budgets)
    return [drafter.propose(s, t, b) for s, t, b in zip(seq_ids, tokens, budgets)]


def update_batch(drafter: Drafter, seq_ids: list[int], results: list[VerifyResult],
                 hidden: list[torch.Tensor | None]) -> None:
    """The round committed results[b] for seq_ids[b]; hidden[b]: its taps on the accepted path or None."""
    batched = getattr(drafter, "update_batch", None)
    if batched is not None:
        return batched(seq_ids, results, hidden)
    for s, r, h in zip(seq_ids, results, hidden):
        drafter.update(s, r, h)


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
