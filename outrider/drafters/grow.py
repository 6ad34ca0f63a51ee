"""Growing every sequence's draft tree together: one drafter forward per draft depth.

A model drafter writes each sequence's drafting as a generator, a *grower*: it yields a `Feed`
(the draft nodes whose K/V and outputs it needs next: their tokens, the tree's parents so far,
the index of the first new node, and for a head the input features), receives the forward's
outputs for exactly those nodes, and finally returns its `DraftTree`:

    def chain(...):                      # one sequence
        out = yield Feed([t1], [-1, 0], first=1)       # the next depth's outputs for node 1
        ...
        return DraftTree.chain(root, drafts)

`grow_together` runs all growers in lock step: every round of asks is ONE forward over the
slots that asked (a sequence whose tree is done, or shallower, drops out), so drafting depth d
for B sequences costs d forwards, not B * d. `grow_alone` is the slow reference: each grower to
its end, one forward per ask; both give the same trees (tests/test_drafter_batched.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Generator

import torch

from ..spec.types import DraftTree


@dataclass(frozen=True)
class Feed:
    tokens: list[int]  # the new nodes' tokens: nodes first .. first + n - 1 of the tree
    parents: list[int] | None  # the fed tree's parents, nodes 0 .. first + n - 1 (node 0: the root's
    # row); None: causal rows (a catch-up of committed tokens)
    first: int
    inputs: torch.Tensor | None = None  # [n, H] input features (a head: each parent's output hidden)


Grower = Generator[Feed, Any, DraftTree]
# forward(indices, feeds) -> one output per feed (the rows of that feed's nodes), in order;
# indices: which growers asked (the caller's per-sequence state is found by them)
BatchForward = Callable[[list[int], list[Feed]], list[Any]]


def done(tree: DraftTree) -> Grower:
    """A grower that feeds nothing (a root-only tree)."""
    return tree
    yield  # unreachable: makes this a generator


def grow_together(growers: list[Grower], forward: BatchForward) -> list[DraftTree]:
    """Drive all growers; each round of asks goes to `forward` in one call."""
    trees: list[DraftTree | None] = [None] * len(growers)
    asks: dict[int, Feed] = {}

    def advance(i: int, value) -> None:
        try:
            asks[i] = growers[i].send(value)
        except StopIteration as done:
            trees[i] = done.value
            asks.pop(i, None)

    for i in range(len(growers)):
        advance(i, None)
    while asks:
        indices = sorted(asks)
        outs = forward(indices, [asks[i] for i in indices])
        for i, out in zip(indices, outs):
            advance(i, out)
    return trees


def grow_alone(growers: list[Grower], forward: BatchForward) -> list[DraftTree]:
    """The reference: one grower at a time, one forward per ask (what a per-sequence drafter does)."""
    trees = []
    for i, grower in enumerate(growers):
        out = None
        while True:
            try:
                feed = grower.send(out)
            except StopIteration as done:
                trees.append(done.value)
                break
            out = forward([i], [feed])[0]
    return trees
