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
root's best child. Popping a candidate takes it as a node and offers its parent's next-ranked
child; a child never outscores its parent, so the N nodes taken are the N most probable prefixes
(at most `depth` deep) and each node's parent is among them. A taken node is expanded (one Markov
step: its children's distribution, ranked, its best child offered) only when its own score, a
bound on its children's, is the best in the heap; then every node waiting is expanded in the same
batched step, and the best candidates not yet taken with them (up to WAVE rows: reading the
Markov head's [Vd, r] output matrix once for many rows costs little more than for one, where one
step a node read it N times). The tree is the same as expanding each node as it is taken (the
tests hold it to the reference). The rnn variant's
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
from collections import defaultdict
from collections.abc import Callable

import torch

from ..spec.types import DraftTree

WAVE = 16  # rows of one batched Markov step: the nodes waiting, then the best candidates not yet taken
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
    carried: dict[int, torch.Tensor] = {}  # node -> the state its children start from [1, r]
    early: dict[tuple[int, int], tuple] = {}  # (parent, rank) of a candidate expanded before it was taken
    taken: dict[int, int] = defaultdict(int)  # node -> its children taken (ranks 0 .. that - 1: taken in order)
    order = itertools.count()
    heap: list[tuple[float, int, int, int]] = []  # (-score, insertion order, node or parent, rank); rank -1: a bound

    def expand(items: list[tuple[int, int]]) -> list[tuple]:
        """One batched Markov step: (node, -1) for a taken node, (parent, rank) for a candidate ->
        per item (its children's log-probs, their target ids, the state they start from)."""
        at, prev, states = [], [], []
        for n, rank in items:
            if rank < 0:
                at.append(depths[n]), prev.append(tokens[n]), states.append(incoming[n])
            else:
                at.append(depths[n] + 1), prev.append(ranked[n][1][rank]), states.append(carried[n])
        state = None if states[0] is None else torch.cat(states)  # [m, r] (None: the root alone, s_0)
        where = torch.tensor(at)
        logits, out = step(base[where], hidden[where], torch.tensor(prev), state)  # [m, Vd], [m, r]
        logits = logits.float()
        top = logits.topk(width, dim=-1)  # values/indices [m, width]
        values = (top.values - torch.logsumexp(logits, -1, keepdim=True)).tolist()
        ids = to_target(top.indices).tolist()
        return [(values[i], ids[i], out[i: i + 1]) for i in range(len(items))]

    def ready(node: int, children: tuple) -> None:
        ranked[node], carried[node] = children[:2], children[2]
        heapq.heappush(heap, (-(scores[node] + children[0][0]), next(order), node, 0))

    ready(0, expand([(0, -1)])[0])
    while heap and len(tokens) - 1 < nodes:
        neg, _, parent, rank = heapq.heappop(heap)
        if -neg < floor:
            break
        if rank < 0:  # a taken node's bound is the best: expand it, every node waiting, and the best candidates
            if parent not in ranked:
                waiting = [(n, -1) for n in range(len(tokens)) if depths[n] < depth and n not in ranked]
                room = max(WAVE - len(waiting), 0)
                offered = ((scores[p] + v[r], p, r) for p, (v, _) in ranked.items() if depths[p] + 1 < depth
                           for r in range(taken[p], min(taken[p] + room, len(v))) if (p, r) not in early)
                ahead = [(p, r) for _, p, r in heapq.nlargest(room, offered)]
                for item, children in zip(waiting + ahead, expand(waiting + ahead)):
                    if item[1] < 0:
                        ready(item[0], children)
                    else:
                        early[item] = children
            continue
        values, ids = ranked[parent]
        taken[parent] = rank + 1
        node = len(tokens)
        tokens.append(ids[rank])
        parents.append(parent)
        scores.append(-neg)
        depths.append(depths[parent] + 1)
        incoming.append(carried[parent])
        if rank + 1 < len(values):  # the parent's next-ranked child
            heapq.heappush(heap, (-(scores[parent] + values[rank + 1]), next(order), parent, rank + 1))
        if (parent, rank) in early:
            ready(node, early.pop((parent, rank)))
        elif depths[node] < depth:  # its children score at most its own score: a bound until expanded
            heapq.heappush(heap, (neg, next(order), node, -1))
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
