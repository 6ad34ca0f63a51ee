"""`--refiner retrace[:SHARE]`: ReTrace, the next block conditioned on the previous round's rejection.

When the verifier rejects a draft, the tokens drafted after it are thrown away, though text often
goes on as drafted once the target's correction has replaced the rejected token (a renamed
variable, a synonym, an inserted or dropped word). ReTrace reads the previous round's result: where
the verifier rejected (the last accepted node of the tree it verified) and the target's
correction (the new root), and offers the rejected suffix again after the correction, realigned
three ways: the correction replaced the rejected draft (substitution: the suffix after it),
was inserted before it (the rejected draft, then its suffix), or dropped it (the suffix less its
first token, when that token equals the correction). Each realignment is a path scored by the
product of the block's own marginals along it, so it competes with the tree it is given (the
block's argmax chain, or DDTree's) for at most SHARE of the node budget (default 0.5).

Exact: it only proposes; the verifier decides. Our reading of the issue's summary (the paper's
own text was not found in the indexes this project can search).
"""

from __future__ import annotations

from ...errors import ConfigError
from ...spec.types import DraftTree
from ..block import Block
from .base import RefinerCost, build_tree, paths_of


def rejected_suffix(tree: DraftTree | None, accepted: list[int], correction: int) -> list[int]:
    """The drafts the verifier threw away: below the last accepted node of `tree`, follow the
    most confident child (the draft the correction replaced) and then the most confident child
    down to a leaf; [] when the last accepted node had no child (the round took every draft)."""
    if tree is None:
        return []
    parents = tree.parents.tolist()
    tokens = tree.tokens.tolist()
    conf = tree.confidence.tolist() if tree.confidence is not None else [1.0] * len(tokens)
    at, out = (accepted[-1] if accepted else 0), []
    while True:
        children = [i for i in range(1, len(tokens)) if parents[i] == at]
        if not children:
            return out
        at = max(children, key=lambda i: (conf[i], -i))
        out.append(tokens[at])


class ReTrace:
    name = "retrace"
    exact = True
    cost = RefinerCost(forwards=0, per_node=True)

    def __init__(self, share: float = 0.5):
        self.share = share

    def refine(self, block: Block, tree: DraftTree, depth: int, nodes: int, greedy: bool) -> DraftTree:
        result = block.previous
        if result is None:
            return tree
        suffix = rejected_suffix(block.previous_tree, result.accepted_nodes, result.tokens[-1])
        if not suffix:
            return tree
        candidates = [suffix[1:], suffix]  # substitution, insertion
        if len(suffix) > 1 and suffix[1] == block.root:
            candidates.append(suffix[2:])  # deletion: the correction is the draft after the rejected one
        mine = [(path[:depth], self._score(block, path[:depth])) for path in candidates if path]
        if not mine:
            return tree
        own = build_tree(block.root, mine, max(1, int(self.share * nodes)), depth)
        kept = build_tree(block.root, paths_of(tree), nodes - (own.size - 1), depth)
        return build_tree(block.root, paths_of(kept) + paths_of(own), nodes, depth)  # the union fits in `nodes`

    @staticmethod
    def _score(block: Block, path: list[int]) -> float:
        """The path's probability under the block's marginals (off the draft vocabulary: 0)."""
        p = 1.0
        for k, token in enumerate(path):
            p *= block.prob(k, token)
        return p


def make(arg: str, head=None, folder=None) -> ReTrace:
    if not arg:
        return ReTrace()
    try:
        share = float(arg)
    except ValueError:
        share = -1.0
    if not 0.0 < share <= 1.0:
        raise ConfigError(f"retrace:{arg}: SHARE is the part of the node budget ReTrace may take, in (0, 1]")
    return ReTrace(share)
