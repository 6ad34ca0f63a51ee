"""`--refiner ddtree`: DDTree as a refiner (the tree of `--tree ddtree:N` without refiners), so
it can be chained with others (`ddtree,retrace`). It ignores the tree it is given."""

from __future__ import annotations

from ...spec.types import DraftTree
from ..block import Block, ddtree
from .base import RefinerCost


class DDTree:
    name = "ddtree"
    exact = True
    cost = RefinerCost(forwards=0, per_node=True)

    def refine(self, block: Block, tree: DraftTree, depth: int, nodes: int, greedy: bool) -> DraftTree:
        return ddtree(block, depth, nodes)


def make(arg: str, head=None, folder=None) -> DDTree:
    from ...errors import ConfigError

    if arg:
        raise ConfigError("the ddtree refiner takes no argument (its node budget is --tree ddtree:N)")
    return DDTree()
