"""S2-MoE's routing-aware expansion of the draft tree (seed #9, card 2.9), for `--drafter
s2moe:K',expand=R[,draft=C]`. Lossless: it only chooses which drafted nodes go to the verify.

While the self-draft runs, every MoE layer's router scores of every drafted row are read, and the
node's predicted target experts E_i are the top k of them (k: the target's experts a token; the
draft itself routes K'). A node the draft never fed (the last depth: nothing is drafted past it)
takes its parent's E. Then, with p_i the node's path confidence (tree.confidence), and costs in
units of one AR step (T_AR = 1):

    B_i  = p_i                                   (expected benefit)
    dC_i = R * |E_i minus the union of E over the admitted nodes|   (the new experts it brings)
    U_i  = B_i / (dC_i + C)
    admit the frontier node of the largest U_i (its parent admitted; the root always is), while U_i >= 1

R = T_exp / T_AR: the cost of bringing one new expert into the verify; C = C_draft / T_AR. The
draft's forwards are paid before the choice here (the tree is grown first, then trimmed), so C is
the paper's admission threshold rather than a cost saved. R = 0 (and C = 0) keeps every node.
`predicted` / `trim` are the pieces; drafters/s2moe.py calls them.
"""

from __future__ import annotations

import torch

from ..models.moe_layer import route, router_scores
from ..spec.types import DraftTree


class RoutePredictor:
    """Inside moe_layer.selecting(self) during a draft forward: routes as the draft does (route()
    honours fewer_experts) and records each fed node's predicted target experts. `rows`: one
    (sequence key, node) or None per flattened row of the forward (b * T + i)."""

    def __init__(self):
        self.rows: list | None = None
        self.experts: dict[tuple, set] = {}  # (sequence key, node) -> {(layer key, expert)}

    def route(self, w, cfg, flat: torch.Tensor):
        out = route(flat, w.router, cfg, w.score_bias)  # the draft's own routing, K' under fewer_experts
        if self.rows is not None and len(self.rows) == flat.shape[0]:
            predicted = torch.topk(router_scores(flat, w.router, cfg), cfg.top_k, dim=-1).indices.tolist()  # [M, k]
            layer = id(w)
            for r, who in enumerate(self.rows):
                if who is not None:
                    self.experts.setdefault(who, set()).update((layer, e) for e in predicted[r])
        return out


def node_experts(tree: DraftTree, found: dict[int, set]) -> list[set]:
    """Each node's predicted experts: its own where the draft fed it, else its nearest fed ancestor's."""
    parents = tree.parents.tolist()
    out: list[set] = []
    for i, parent in enumerate(parents):
        out.append(found.get(i) if i in found else (out[parent] if parent >= 0 else set()))
    return out


def trim(tree: DraftTree, experts: list[set], cost: float, draft: float = 0.0) -> DraftTree:
    """The routing-aware expansion (module notes) of `tree` (with confidences): the admitted nodes,
    reindexed in their order. cost: R; draft: C. A tree without confidences is returned whole."""
    if tree.confidence is None or tree.size == 1 or (cost == 0.0 and draft == 0.0):
        return tree
    parents = tree.parents.tolist()
    conf = tree.confidence.tolist()
    kids: list[list[int]] = [[] for _ in parents]
    for i, p in enumerate(parents[1:], start=1):
        kids[p].append(i)
    union = set(experts[0])
    admitted = [0]
    frontier = list(kids[0])
    while frontier:
        best, best_u = None, -1.0
        for i in frontier:
            denominator = cost * len(experts[i] - union) + draft
            u = float("inf") if denominator == 0 else conf[i] / denominator
            if u > best_u or (u == best_u and i < best):
                best, best_u = i, u
        if best_u < 1.0:
            break
        admitted.append(best)
        union |= experts[best]
        frontier.remove(best)
        frontier.extend(kids[best])
    keep = sorted(admitted)
    index = {old: new for new, old in enumerate(keep)}
    at = torch.tensor(keep, dtype=torch.long)
    return DraftTree(tree.tokens[at], torch.tensor([-1] + [index[parents[i]] for i in keep[1:]], dtype=torch.long),
                     None if tree.draft_probs is None else tree.draft_probs[at], tree.confidence[at])


def trim_reference(tree: DraftTree, experts: list[set], cost: float, draft: float = 0.0) -> list[int]:
    """The slow form: the admitted nodes' original indices, each step re-scoring every node."""
    if tree.confidence is None or tree.size == 1 or (cost == 0.0 and draft == 0.0):
        return list(range(tree.size))
    parents, conf = tree.parents.tolist(), tree.confidence.tolist()
    admitted = {0}
    while True:
        union = set().union(*(experts[i] for i in admitted))
        options = []
        for i in range(1, tree.size):
            if i in admitted or parents[i] not in admitted:
                continue
            d = cost * len(experts[i] - union) + draft
            options.append((float("inf") if d == 0 else conf[i] / d, -i))
        if not options or max(options)[0] < 1.0:
            return sorted(admitted)
        admitted.add(-max(options)[1])

