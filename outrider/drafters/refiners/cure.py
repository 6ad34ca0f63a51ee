"""`--refiner cure[:H]`: CURE, repair the block where it is unsure instead of branching everywhere.

A block drafter's positions are not equally reliable: most are near-certain, a few are guesses.
A fixed top-k tree spends its nodes evenly; CURE finds the block's uncertain positions (entropy of
each position's draft distribution at or above H nats, default 0.5) and repairs there only: at an
uncertain position k it offers the next-ranked tokens as siblings of the chain's node, each
followed by the chain's own continuation (the rest of the block's argmax), so one wrong guess no
longer ends the round there. Repairs are taken by their expected worth (the probability, under
the block's marginals, that the chain is right up to k and the repair token right at k) until the
node budget is spent: a small budget-aware tree around the chain it is given (the block's argmax
chain, or a previous refiner's tree, whose best nodes keep half the budget).

Exact: it only proposes. Our reading of the issue's summary (the paper's own text was not found in
the indexes this project can search).
"""

from __future__ import annotations

from ...errors import ConfigError
from ...spec.types import DraftTree
from ..block import Block
from .base import RefinerCost, build_tree, paths_of

WIDTH = 3  # alternatives tried per uncertain position


class CURE:
    name = "cure"
    exact = True
    cost = RefinerCost(forwards=0, per_node=True)

    def __init__(self, threshold: float = 0.5):
        self.threshold = threshold

    def refine(self, block: Block, tree: DraftTree, depth: int, nodes: int, greedy: bool) -> DraftTree:
        depth = min(depth, block.size)
        if depth < 1:
            return tree
        logp = block.logp[:depth]  # [depth, Vd]
        top = logp.topk(min(WIDTH + 1, logp.shape[-1]), dim=-1)
        probs, ids = top.values.exp().tolist(), block.target_ids(top.indices).tolist()
        chain = [row[0] for row in ids]
        reach = [1.0]  # probability the chain is right up to position k (before it)
        for k in range(depth):
            reach.append(reach[-1] * probs[k][0])
        entropy = block.entropy()[:depth].tolist()
        repairs = []  # (worth, path)
        for k in range(depth):
            if entropy[k] < self.threshold:
                continue
            for r in range(1, len(ids[k])):
                worth = reach[k] * probs[k][r]
                path = chain[:k] + [ids[k][r]]
                for j in range(k + 1, depth):
                    path.append(chain[j])
                repairs.append((worth, path))
        if not repairs:
            return tree
        repairs.sort(key=lambda x: -x[0])
        # the given tree's best nodes keep half the budget (the chain alone keeps all it has)
        given = paths_of(tree)
        keep = build_tree(block.root, given, max(nodes // 2, min(nodes, depth)), depth)
        scored = paths_of(keep) + [(path, worth) for worth, path in repairs]
        return build_tree(block.root, scored, nodes, depth)


def make(arg: str, head=None, folder=None) -> CURE:
    if not arg:
        return CURE()
    try:
        threshold = float(arg)
    except ValueError:
        threshold = -1.0
    if threshold < 0:
        raise ConfigError(f"cure:{arg}: H is the entropy (nats) from which a position is repaired, >= 0")
    return CURE(threshold)
