"""The trims of a round's draft trees: which drafted nodes to verify, best first.

`marginal_trim` is LibraSpec's marginal rule (keep widening the round while what a node adds to
the expected commit pays for its verify cost), `threshold_trim` the plain confidence threshold
it is compared with. Both offer a tree's nodes through `Offer`: one node at a time, or a sampled
tree's families of siblings, with gains that never look at a node's own token (libraspec.py's
notes: why that keeps sampled trees exact). The controllers that call them: libraspec.py.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable

import torch

from ..spec.tree import children
from ..spec.types import DraftTree


@dataclass(frozen=True)
class Step:
    """Nodes offered together for verification (one node; a sampled tree's family of siblings),
    and their gain: the tokens they add to the round's expected commit."""

    nodes: tuple[int, ...]
    gain: float


class Offer:
    """One tree's nodes, offered best first: a heap of the steps whose parent is kept.

    Without q: every node is a step of gain confidence[node]. With q (draft_probs): a node's
    children are one step of gain confidence[node] * (1 - (1 - Σ q_node²)^m), m children."""

    def __init__(self, tree: DraftTree):
        self.tree = tree
        self.confidence = tree.confidence.tolist()  # [n]
        self.kids = children(tree.parents.tolist())
        self.sampled = tree.draft_probs is not None
        self.kept = [0]
        self._deferred: list[int] = []  # kept nodes whose children are not offered yet
        self._heap: list[tuple[float, int, Step]] = []
        self._open(0)

    def _open(self, node: int) -> None:
        kids = self.kids[node]
        if not kids:
            return
        if self.sampled:
            q = self.tree.draft_probs[node].double()  # [vocab]
            share = float((q * q).sum() / max(float(q.sum()) ** 2, 1e-300))  # E_{x~q} q(x)
            gain = self.confidence[node] * (1.0 - (1.0 - min(share, 1.0)) ** len(kids))
            heapq.heappush(self._heap, (-gain, kids[0], Step(tuple(kids), gain)))
        else:
            for kid in kids:
                heapq.heappush(self._heap, (-self.confidence[kid], kid, Step((kid,), self.confidence[kid])))

    @property
    def best(self) -> Step | None:
        return self._heap[0][2] if self._heap else None

    def take(self, defer: bool = False) -> Step:
        """Keep the best step; its children are offered now, or with `defer` at `open_deferred`."""
        step = heapq.heappop(self._heap)[2]
        self.kept.extend(step.nodes)
        if defer:
            self._deferred.extend(step.nodes)
        else:
            for node in step.nodes:
                self._open(node)
        return step

    def open_deferred(self) -> None:
        for node in self._deferred:
            self._open(node)
        self._deferred = []

    def result(self) -> DraftTree:
        return subtree(self.tree, self.kept)

    def save(self) -> tuple:
        return list(self._heap), len(self.kept)

    def restore(self, saved: tuple) -> None:
        self._heap, kept = list(saved[0]), saved[1]
        del self.kept[kept:]
        self._deferred = []


def subtree(tree: DraftTree, keep: list[int]) -> DraftTree:
    """The nodes `keep` of `tree` (node 0 and each kept node's parent among them), renumbered in
    their order, with their draft_probs and confidence rows."""
    keep = sorted(keep)
    if len(keep) == tree.size:
        return tree
    index = {old: new for new, old in enumerate(keep)}
    parents = tree.parents.tolist()
    rows = torch.tensor(keep)
    return DraftTree(tree.tokens[rows], torch.tensor([-1] + [index[parents[n]] for n in keep[1:]]),
                     None if tree.draft_probs is None else tree.draft_probs[rows],
                     None if tree.confidence is None else tree.confidence[rows])


def marginal_trim(trees: list[DraftTree], batch_size: int, verify_cost: Callable[[int], float],
                  draft_s: float) -> list[DraftTree]:
    """LibraSpec's rule over one round: verify_cost(width) is the round's verify forward with
    every tree padded to `width` tokens, draft_s the round's drafting time.

    The round's width grows one token at a time while what the widening adds pays for it: each
    sequence takes its best steps that fit the new width (one node at batch 1: the paper's rule),
    and the widening is kept when the sum of their gains G satisfies G * T >= E * (cost of the
    wider forward - cost of this one). Steps that fit the current width cost nothing and are
    taken first. Trees without confidence are verified whole (their width is free for the rest)."""
    offers = [Offer(t) if t.confidence is not None and t.size > 1 else None for t in trees]
    size = [1 if offer else t.size for t, offer in zip(trees, offers)]
    width = max(size, default=1)
    expected = float(batch_size)  # every sequence of the round commits a token without drafts

    def fill(upto: int, defer: bool) -> float:
        """Take each sequence's best steps while they fit `upto` tokens; the gain they add. With
        `defer`, only steps offered before this call (see below)."""
        gain = 0.0
        for i, offer in enumerate(offers):
            while offer and offer.best and offer.best.gain > 0.0 and size[i] + len(offer.best.nodes) <= upto:
                size[i] += len(offer.best.nodes)
                gain += offer.take(defer).gain
        return gain

    expected += fill(width, defer=False)  # the padding is free
    while any(offer and offer.best and offer.best.gain > 0.0 for offer in offers):
        smallest = min(size[i] + len(o.best.nodes) for i, o in enumerate(offers) if o and o.best and o.best.gain > 0)
        wider = max(width + 1, smallest)
        saved = [(offer.save(), size[i]) if offer else None for i, offer in enumerate(offers)]
        now = verify_cost(width)
        # the widening is judged on steps offered before it: a step's children are offered only
        # once it is kept for good, so whether a node is kept never depends on the gains below
        # it (they depend on its own token, which a tree verified against q must not be chosen by)
        gain = fill(wider, defer=True)
        if gain * (draft_s + now) < expected * (verify_cost(wider) - now):
            for i, (offer, kept) in enumerate(zip(offers, saved)):
                if offer:
                    offer.restore(kept[0])
                    size[i] = kept[1]
            break  # the marginal criterion failed: the round verifies what it has
        width, expected = wider, expected + gain
        for offer in offers:
            if offer:
                offer.open_deferred()
        expected += fill(width, defer=False)
    return [offer.result() if offer else t for t, offer in zip(trees, offers)]


def threshold_trim(trees: list[DraftTree], threshold: float) -> list[DraftTree]:
    """Verify the steps of gain >= threshold (best first, so every kept node's parent is kept)."""
    out = []
    for tree in trees:
        if tree.confidence is None or tree.size == 1:
            out.append(tree)
            continue
        offer = Offer(tree)
        while offer.best is not None and offer.best.gain >= threshold:
            offer.take()
        out.append(offer.result())
    return out
