"""`--controller batch-verify:K[,budget=N]`: AngelSpec's batch-level verification allocation (seed card 2.25).

Every drafting sequence drafts up to K deep (its tree shape's nodes at depth K); then the round's
verify work is one budget shared by all of them, spent on the highest-confidence prefixes across
the requests, best first (`allocate`): the next node kept is the one, over every tree, with the
highest gain (its path confidence; a sampled tree's family of siblings as one step, with the gain
libraspec_trim.Offer gives it, which never looks at a node's own token), and a node is offered only
once its parent is kept, so every tree stays prefix-closed.

How much is spent:
- `budget=N`: at most N drafted nodes over the whole round (a tree without confidences is kept
  whole and its nodes count first);
- without it, by the measured cost model (batch_cost.py: the verify forward's seconds for B
  sequences padded to width T, scaled by the verify times this controller observes): the next step
  is taken while what it adds to the round's expected commit pays for what it adds to the verify,
  g * C(B, T) >= E * (C(B, T') - C(B, T)) (E the expected tokens so far, T' the width with it), and
  the allocation stops at the first step that does not (a stopping rule: whether a node is kept
  never depends on gains offered after it, so it never depends on its own token).

Drafting is paid before the allocation, so only the verify is priced. Lossless: the verifiers see
subtrees of the drafted trees (greedy: equal to plain decoding; sampled: the exact verifiers).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from ..errors import ConfigError
from ..spec.types import Budget, DraftTree, VerifyResult
from .controllers import register_controller
from .libraspec_trim import Offer

USAGE = "batch-verify:K[,budget=N]"


def allocate(trees: list[DraftTree], budget: int | None = None,
             verify_cost: Callable[[int], float] | None = None) -> list[DraftTree]:
    """The round's trees -> the subtrees to verify (module docstring). budget: drafted nodes over
    all trees (None: no cap); verify_cost(width) -> seconds of the round's verify padded to
    `width` (None: no pricing, the budget alone)."""
    offers = [Offer(t) if t.confidence is not None and t.size > 1 else None for t in trees]
    whole = sum(t.size - 1 for t, o in zip(trees, offers) if o is None)
    left = None if budget is None else budget - whole
    size = [1 if o else t.size for t, o in zip(trees, offers)]
    expected = float(len(trees)) + sum(float(t.confidence[1:].sum()) for t, o in zip(trees, offers)
                                       if o is None and t.confidence is not None)
    heap = [(-o.best.gain, i) for i, o in enumerate(offers) if o and o.best]
    heapq.heapify(heap)
    while heap:
        _, i = heapq.heappop(heap)
        step = offers[i].best
        if step.gain <= 0.0 or (left is not None and len(step.nodes) > left):
            if left is not None and step.gain > 0.0:
                continue  # a family too large for what is left: the others may still fit
            break
        if verify_cost is not None:
            width = max(size)
            wider = max(width, size[i] + len(step.nodes))
            if step.gain * verify_cost(width) < expected * (verify_cost(wider) - verify_cost(width)):
                break  # the first step that does not pay ends the allocation
        offers[i].take()
        size[i] += len(step.nodes)
        expected += step.gain
        if left is not None:
            left -= len(step.nodes)
        if offers[i].best is not None:
            heapq.heappush(heap, (-offers[i].best.gain, i))
    return [o.result() if o else t for t, o in zip(trees, offers)]


class BatchVerifyController:
    """Drafts K deep for every sequence; `trim` allocates the round's shared verify budget."""

    def __init__(self, depth: int, budget: int | None = None, batch_profile=None, profile=None):
        self.name = f"batch-verify:{depth}" + (f",budget={budget}" if budget is not None else "")
        self.depth = self.max_depth = depth
        self.budget = budget
        self._source, self._table, self._profile = batch_profile, None, profile
        self.scale = 1.0  # measured verify seconds / the table's (a moving average: the machine's load)
        self.drafted = self.verified = 0  # drafted and verified nodes, over the run

    def start(self, seq_id: int) -> None:
        pass

    def finish(self, seq_id: int) -> None:
        pass

    def budget_for(self, nodes_for) -> Budget:
        return Budget(self.depth, nodes_for(self.depth), 0.0)

    def budget(self, seq_id: int) -> Budget:
        return self.budget_for(lambda depth: depth)  # one sequence alone, as libraspec's: a chain's nodes

    def budgets(self, seq_ids: list[int], batch_size: int, nodes_for) -> list[Budget]:
        return [self.budget_for(nodes_for)] * len(seq_ids)

    def trim(self, seq_ids: list[int], trees: list[DraftTree], batch_size: int) -> list[DraftTree]:
        priced = None if self.budget is not None else self._pricing(batch_size)
        kept = allocate(trees, self.budget, priced)
        self.drafted += sum(t.size - 1 for t in trees)
        self.verified += sum(t.size - 1 for t in kept)
        return kept

    def _pricing(self, batch_size: int):
        table = self._table
        if callable(self._source) and (table is None or table.batches[-1] < batch_size):
            table = self._table = self._source(batch_size)
        elif table is None and self._source is not None and not callable(self._source):
            table = self._table = self._source
        if table is not None:
            return lambda width: self.scale * table.cost(batch_size, width)
        if self._profile is not None:
            return lambda width: self.scale * self._profile.cost(batch_size * width)
        return None  # nothing measured: the budget alone (none: every drafted node)

    def observe(self, seq_id: int, tree: DraftTree, result: VerifyResult) -> None:
        pass

    def observe_draft_time(self, seconds: float, depth: int) -> None:
        pass

    def observe_verify_time(self, batch_size: int, width: int, seconds: float) -> None:
        table = self._table
        if table is not None and seconds > 0:
            self.scale += 0.2 * (seconds / max(table.cost(batch_size, width), 1e-9) - self.scale)

    def prepare(self, max_batch: int) -> None:
        if max_batch > 1 and callable(self._source):
            self._pricing(max_batch)


def parse(argument: str) -> tuple[int, int | None]:
    """`K[,budget=N]` -> (K, N or None)."""
    head, *rest = argument.split(",") if argument else [""]
    try:
        depth = int(head)
        options = dict(part.split("=", 1) for part in rest)
        budget = int(options.pop("budget")) if "budget" in options else None
    except ValueError:
        raise ConfigError(f"use {USAGE} (K the depth each sequence drafts, N the drafted nodes a round verifies)") from None
    if options or not 1 <= depth <= 64 or (budget is not None and budget < 0):
        raise ConfigError(f"use {USAGE}: K in 1..64, budget=N >= 0, no other option")
    return depth, budget


def _factory(argument: str, profile_factory=None, batch_profile_factory=None) -> BatchVerifyController:
    depth, budget = parse(argument)
    profile = profile_factory() if profile_factory is not None and budget is None else None
    return BatchVerifyController(depth, budget, batch_profile_factory if budget is None else None, profile)


register_controller("batch-verify", _factory, USAGE, profiles=True)
