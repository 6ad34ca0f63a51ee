"""The refiner interface (see the package docstring)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ...spec.types import DraftTree
from ..block import Block


@dataclass(frozen=True)
class RefinerCost:
    """What a refiner adds to a proposal: `forwards` extra network forwards per round (a trained
    refiner's head; each over the round's frontier, batched across sequences) and `per_node`
    whether its host work grows with the node budget. The cost controller measures the draft time
    itself; this is what the method reports and docs/methods.md tabulates."""

    forwards: int = 0
    per_node: bool = True


class Refiner(Protocol):
    name: str
    exact: bool  # True: it changes only proposals (every refiner here); a lossy one would say False
    cost: RefinerCost

    def refine(self, block: Block, tree: DraftTree, depth: int, nodes: int, greedy: bool) -> DraftTree:
        """A tree rooted at block.root with at most `nodes` drafts, at most `depth` deep (depth <=
        block.size), from the block and the tree so far (`tree`: the block's argmax chain for
        the first refiner)."""


def paths_of(tree: DraftTree) -> list[tuple[list[int], float]]:
    """Every node of `tree` as (its path of tokens below the root, its confidence: 1.0 when the
    tree carries none)."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    conf = tree.confidence.tolist() if tree.confidence is not None else [1.0] * len(tokens)
    paths: list[list[int]] = [[]]
    for i in range(1, len(tokens)):
        paths.append(paths[parents[i]] + [tokens[i]])
    return [(paths[i], conf[i]) for i in range(1, len(tokens))]


def build_tree(root: int, scored: list[tuple[list[int], float]], nodes: int, depth: int) -> DraftTree:
    """The draft tree of the `nodes` best prefixes of the scored paths (at most `depth` deep): a
    prefix scores the best of the paths through it, so it never scores below its extensions and
    the kept set is closed under taking parents (ties go to the shorter prefix, then the first
    offered). The confidence of a node is its score."""
    best: dict[tuple[int, ...], float] = {}
    order: dict[tuple[int, ...], int] = {}
    for path, score in scored:
        for d in range(1, min(len(path), depth) + 1):
            key = tuple(path[:d])
            if key not in best or score > best[key]:
                best[key] = score
            order.setdefault(key, len(order))
    kept = sorted(best, key=lambda k: (-best[k], len(k), order[k]))[:nodes]
    kept.sort(key=lambda k: (len(k), order[k]))  # parents before children
    index = {(): 0}
    tokens, parents, confidence = [root], [-1], [1.0]
    for key in kept:
        index[key] = len(tokens)
        tokens.append(key[-1])
        parents.append(index[key[:-1]])
        confidence.append(best[key])
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), confidence=torch.tensor(confidence))
