"""PCTree (`--tree pctree:N`, docs/methods.md#pctree): a parent-conditioned draft tree from one DSpark block.

PCTree (arXiv 2608.02123; llama.cpp issue #27499) turns DSpark's drafted chain into a tree without
another backbone pass. DSpark's backbone gives every block position k (1..gamma) base logits U_k
and a hidden state hbar_k once (heads/dspark/head.py `block`); its Markov head corrects position
k's logits by the token before it (`step`). DDTree (block.py) scores a position's tokens by the
marginal U_k alone, the same for every parent; PCTree scores the children of each node by the
Markov head given that node's own token:

    p_k(v | node) = softmax(U_k + bias(x = node's token, hbar_k, the node's Markov state))
    score(path)   = sum of log p along it (path probability = product)

Best-first under a node budget N: a heap of candidate nodes keyed by score, seeded with the
root's best child. Popping a candidate adds it as a node, expands it (one Markov step: its
children's distribution, ranked) and offers its best child and its own next sibling (the parent's
next-ranked token). A child never outscores its parent, so the N nodes taken are the N most
probable prefixes (at most `depth` deep) and each node's parent is among them. The rnn variant's
state rides with each node to its children. Budget.min_confidence stops the expansion once the
best candidate's path probability falls below it. The tree is deterministic given the block, so it
is verified by the tree walk at any temperature (exact).

    pctree(root, base [D, Vd], hidden [D, H], step, to_target, depth, nodes) -> DraftTree
    pctree_reference(...)   the same set by enumerating every path (tiny vocabularies; the tests)

`step(base [N, Vd], hidden [N, H], prev [N] target ids, state [N, r] | None) -> (logits [N, Vd],
state)` is DSparkHead.step; `to_target(draft ids) -> target ids` its target_ids.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable

import torch

from ..spec.types import DraftTree

Step = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]]


def pctree(root: int, base: torch.Tensor, hidden: torch.Tensor, step: Step, to_target: Callable, depth: int,
           nodes: int, min_confidence: float = 0.0) -> DraftTree:
    """The `nodes` most probable prefixes (at most `depth` deep; depth <= D) of the block whose
    position k+1 has base logits base[k] [Vd] and hidden state hidden[k] [H], each node's children
    scored by `step` given the node's token (module docstring). Confidence: path probability."""
    depth = min(depth, int(base.shape[0]))
    if depth < 1 or nodes < 1:
        return DraftTree.root_only(root)
    width = min(nodes, int(base.shape[-1]))
    floor = math.log(min_confidence) if min_confidence > 0 else -math.inf
    tokens, parents, scores, depths = [root], [-1], [0.0], [0]
    incoming: list[torch.Tensor | None] = [None]  # each node's Markov state before its step (the root's: s_0)
    ranked: dict[int, tuple[list[float], list[int]]] = {}  # node -> its children's (log-probs, target ids), best first
    carried: dict[int, torch.Tensor] = {}  # node -> the state its children start from

    def expand(node: int) -> None:
        """One Markov step: node's children at position depths[node] + 1, ranked."""
        d = depths[node]
        logits, carried[node] = step(base[d: d + 1], hidden[d: d + 1], torch.tensor([tokens[node]]),
                                     incoming[node])  # [1, Vd], [1, r]
        top = torch.log_softmax(logits[0].float(), -1).topk(width)  # values/indices [width]
        ranked[node] = (top.values.tolist(), to_target(top.indices).tolist())

    expand(0)
    order = itertools.count()
    heap = [(-ranked[0][0][0], next(order), 0, 0)]  # (-score, insertion order, parent node, rank)
    while heap and len(tokens) - 1 < nodes:
        neg, _, parent, rank = heapq.heappop(heap)
        if -neg < floor:
            break
        values, ids = ranked[parent]
        node = len(tokens)
        tokens.append(ids[rank])
        parents.append(parent)
        scores.append(-neg)
        depths.append(depths[parent] + 1)
        incoming.append(carried[parent])
        if rank + 1 < len(values):  # the parent's next-ranked child
            heapq.heappush(heap, (-(scores[parent] + values[rank + 1]), next(order), parent, rank + 1))
        if depths[node] < depth and len(tokens) - 1 < nodes:  # this node's best child
            expand(node)
            heapq.heappush(heap, (-(scores[node] + ranked[node][0][0]), next(order), node, 0))
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), confidence=torch.tensor(scores).exp())


def pctree_reference(root: int, base: torch.Tensor, hidden: torch.Tensor, step: Step, to_target: Callable,
                     depth: int, nodes: int) -> list[tuple[tuple[int, ...], float]]:
    """The slow reference: every path up to `depth` scored by running `step` along it, the
    `nodes` best as (path of target ids, log-probability), best first. Tiny vocabularies only."""
    depth = min(depth, int(base.shape[0]))
    out: list[tuple[tuple[int, ...], float]] = []
    frontier = [((), 0.0, root, None)]  # (path, score, last token, Markov state)
    for d in range(depth):
        grown = []
        for path, score, last, state in frontier:
            logits, new = step(base[d: d + 1], hidden[d: d + 1], torch.tensor([last]), state)
            logp = torch.log_softmax(logits[0].double(), -1)
            for v in range(logp.shape[0]):
                token = int(to_target(torch.tensor([v]))[0])
                grown.append((path + (token,), score + float(logp[v]), token, new))
        out += [(p, s) for p, s, _, _ in grown]
        frontier = grown
    out.sort(key=lambda x: -x[1])
    return out[:nodes]
