"""GLANCE's budget tree (`--tree glance:N[,K[,E]]`, docs/methods.md#glance) from a block drafter's block.

GLANCE (Lee et al., "one-pass block drafting", code js-lee-AI/GLANCE) drafts a whole block in one
DFlash pass and spends width inside the verify pass instead of in extra draft passes:

    budget tree     the block's positions are independent given the context, so a path's score is
                    the sum of its positions' log-probabilities; best-first from a heap seeded with
                    position 1's top K, popping a node pushes its K children at the next position,
                    until N nodes are kept. A child never outscores its parent, so the N kept are
                    prefix-closed (each node's parent is kept before it): the optimal N-node tree
                    under that score. K = 8 is the paper's branch_k, N = 63 its budget.
    extra pass      (E > 0) when the tree reaches the block's end and the greedy spine (each
                    position's argmax) has path probability >= SPINE_THRESHOLD, one more block
                    forward with the spine revealed prices the B positions past the block; their
                    E best nodes (EXTRA_BRANCH candidates a position) hang off the spine's leaf.
                    The spine is added first where the budget tree lacks part of it (out of the
                    E nodes, so a tree never holds more than N + E drafts). Candidates
                    only widen the tree: the verify walk, and so the output, is unchanged.

DDTree (block.py `ddtree`) keeps the same N-best set by a first-child/next-sibling heap and no
branch limit; this file is GLANCE's formulation, with its branch factor and its extra pass.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable

import torch

from ..spec.types import DraftTree
from .block import Block

SPINE_THRESHOLD = 0.30  # GLANCE's extend_threshold: the spine path probability that buys the extra pass
EXTRA_BRANCH = 4  # GLANCE's extend_branch: candidates a position past the block


def top_candidates(block: Block, logp: torch.Tensor, branch: int) -> tuple[list[list[float]], list[list[int]]]:
    """logp: [D, Vd] per-position log-probs -> each position's top `branch` (log-probs, target ids),
    ranked: two [D][k] lists."""
    top = logp.topk(min(branch, logp.shape[-1]), dim=-1)  # values/indices [D, k]
    return top.values.tolist(), block.target_ids(top.indices).tolist()


def budget_nodes(values: list[list[float]], ids: list[list[int]], nodes: int) -> list[tuple[int, int, float]]:
    """The `nodes` best prefix-closed nodes of a block, best-first. values/ids: [D][k] each
    position's ranked candidates (top_candidates). Returns (parent, token, score) per node,
    parents first; parent -1 is the block's root, node j is index j of the list."""
    if not values or nodes < 1:
        return []
    D, k = len(values), len(values[0])
    heap = [(-values[0][r], r, -1, 0, r) for r in range(k)]  # (-score, insertion order, parent, position, rank)
    heapq.heapify(heap)
    order, out = k, []
    while heap and len(out) < nodes:
        neg, _, parent, d, r = heapq.heappop(heap)
        out.append((parent, ids[d][r], -neg))
        if d + 1 < D:
            for r2 in range(k):
                heapq.heappush(heap, (neg - values[d + 1][r2], order, len(out) - 1, d + 1, r2))
                order += 1
    return out


def glance_tree(block: Block, depth: int, nodes: int, branch: int, extra: int = 0,
                past_block: Callable[[list[int]], torch.Tensor] | None = None) -> DraftTree:
    """GLANCE's tree for one block: the budget tree of `nodes` nodes at most `depth` deep, plus,
    when `extra` > 0 and the spine qualifies, the extra pass's `extra` nodes past the block.
    past_block(spine target ids [B-1]) -> [B, Vd] draft logits of the B positions past the block
    (one more block forward with the spine revealed)."""
    depth = min(depth, block.size)
    if depth < 1 or nodes < 1:
        return DraftTree.root_only(block.root)
    logp = block.logp[:depth]  # [depth, Vd]
    kept = budget_nodes(*top_candidates(block, logp, branch), nodes)
    tokens, parents, scores = [block.root], [-1], [0.0]
    for parent, token, score in kept:
        tokens.append(token)
        parents.append(parent + 1)
        scores.append(score)
    spine_logp = logp.max(-1)  # values/indices [depth]
    spine_score = float(spine_logp.values.sum())
    if extra > 0 and past_block is not None and depth == block.size and spine_score >= math.log(SPINE_THRESHOLD):
        spine = block.target_ids(spine_logp.indices).tolist()
        before = len(tokens)
        leaf = _ensure_path(tokens, parents, scores, spine, spine_logp.values.tolist())
        past = torch.log_softmax(past_block(spine).float(), dim=-1)  # [B, Vd]
        more = budget_nodes(*top_candidates(block, past, EXTRA_BRANCH), extra - (len(tokens) - before))
        base = len(tokens)
        for parent, token, score in more:
            tokens.append(token)
            parents.append(leaf if parent < 0 else base + parent)
            scores.append(scores[leaf] + score)
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), confidence=torch.tensor(scores).exp())


def _ensure_path(tokens: list[int], parents: list[int], scores: list[float], path: list[int],
                 logps: list[float]) -> int:
    """Walk `path` down from the root, appending the nodes the tree lacks; the leaf's index."""
    node = 0
    for token, lp in zip(path, logps):
        child = next((i for i in range(1, len(tokens)) if parents[i] == node and tokens[i] == token), None)
        if child is None:
            tokens.append(token)
            parents.append(node)
            scores.append(scores[node] + lp)
            child = len(tokens) - 1
        node = child
    return node
