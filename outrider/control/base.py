"""The controller protocol: every hook the engine calls, and `PerSequence` with their defaults.

A controller decides how much each sequence drafts this round and learns from the rounds; it
never changes what is committed, so every controller is lossless. The round (engine/round.py)
calls, in order: `budgets` for the drafting sequences, `observe_draft_time` after the proposal,
`trim` on the proposed trees, `observe_verify_time` after the verify forward, and `observe` per
sequence with the tree verified and its result. The speculator (engine/speculator.py) calls
`prepare` once per engine, `start` as a sequence starts drafting and `finish` when it ends.
"""

from __future__ import annotations

from typing import Callable, Protocol

from ..spec.types import Budget, DraftTree, VerifyResult


class Controller(Protocol):
    name: str
    max_depth: int  # the engine sizes its trees and K/V headroom from this

    def start(self, seq_id: int) -> None: ...

    def budget(self, seq_id: int) -> Budget: ...

    def observe(self, seq_id: int, tree: DraftTree, result: VerifyResult) -> None: ...

    def observe_draft_time(self, seconds: float, depth: int) -> None:
        """A proposal `depth` deep took `seconds` (one sequence's share; measured by the round,
        not after a sequence's first proposal, which writes its prompt's rows in a head)."""

    def budgets(self, seq_ids: list[int], batch_size: int, nodes_for: Callable[[int], int]) -> list[Budget]:
        """Budgets for the drafting sequences of one round whose verify forward carries
        `batch_size` sequences (drafting or not); nodes_for(depth): the tree nodes at that depth."""

    def trim(self, seq_ids: list[int], trees: list[DraftTree], batch_size: int) -> list[DraftTree]:
        """The drafter's trees for these sequences -> the trees to verify, each a subtree of its own
        (parents before children; draft_probs and confidence rows kept with their nodes). Called
        after every proposal, before verification, for a round of `batch_size` sequences."""

    def observe_verify_time(self, batch_size: int, width: int, seconds: float) -> None:
        """A verify forward over `batch_size` sequences padded to `width` tokens took this long."""

    def prepare(self, max_batch: int) -> None:
        """Rounds of up to `max_batch` sequences are coming: measure what that needs now."""

    def finish(self, seq_id: int) -> None:
        """The sequence ended: forget its state (a server sees an unbounded stream of them)."""


HOOKS = ("start", "budgets", "observe", "observe_draft_time", "trim", "observe_verify_time", "prepare", "finish")


class PerSequence:
    """The defaults of every hook but `start`, `budget` and `observe`, for a controller whose
    depth is each sequence's own business: a round's budgets are each sequence's `budget`, every
    draft is verified (`trim` keeps the trees), and draft and verify times, batch sizes and
    endings are ignored (a subclass that keeps per-sequence state overrides `finish` to drop it;
    one that prices the whole batch, as `cost` and `libraspec` do, overrides `budgets` and the
    timing hooks)."""

    def budgets(self, seq_ids: list[int], batch_size: int, nodes_for: Callable[[int], int]) -> list[Budget]:
        return [self.budget(s) for s in seq_ids]

    def trim(self, seq_ids: list[int], trees: list[DraftTree], batch_size: int) -> list[DraftTree]:
        return trees

    def observe_draft_time(self, seconds: float, depth: int) -> None:
        pass

    def observe_verify_time(self, batch_size: int, width: int, seconds: float) -> None:
        pass

    def prepare(self, max_batch: int) -> None:
        pass

    def finish(self, seq_id: int) -> None:
        pass


def missing_hooks(controller) -> list[str]:
    """The hooks of HOOKS that `controller` does not have (the speculator refuses it)."""
    return [hook for hook in HOOKS if not callable(getattr(controller, hook, None))]
