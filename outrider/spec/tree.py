"""Pure functions over parent pointers: depths, ancestor masks, root-to-leaf paths.

Worked example, parents = [-1, 0, 0, 1]:

    depth          [0, 1, 1, 2]
    ancestor mask  node 0: {0}          row i = row of parents[i], plus i itself
                   node 1: {0, 1}
                   node 2: {0, 2}
                   node 3: {0, 1, 3}
    paths          [0, 1, 3], [0, 2]    (one per leaf)
"""

from __future__ import annotations

import torch


def tree_problem(tokens: torch.Tensor, parents: torch.Tensor, draft_probs: torch.Tensor | None,
                 vocab: int) -> str | None:
    """Why a drafted tree cannot be verified, or None when it is well formed. Checked before every
    verify forward (a few microseconds for the trees drafters build), so a drafter bug cannot
    build a wrong ancestor mask silently.

    tokens: [n] long in [0, vocab); parents: [n] long, parents[0] == -1 and 0 <= parents[i] < i;
    draft_probs: None or [n, >= vocab] (the drafter's q per node).
    """
    n = tokens.shape[0] if tokens.dim() == 1 else -1
    if n < 1 or parents.dim() != 1 or parents.shape[0] != n:
        return f"tokens {tuple(tokens.shape)} and parents {tuple(parents.shape)} must both be [n], n >= 1"
    if tokens.dtype != torch.long or parents.dtype != torch.long:
        return f"tokens and parents must be int64 tensors, got {tokens.dtype} and {parents.dtype}"
    if draft_probs is not None and (draft_probs.dim() != 2 or draft_probs.shape[0] != n):
        return f"draft_probs {tuple(draft_probs.shape)} must be [n={n}, vocab]"
    plist, tlist = parents.tolist(), tokens.tolist()  # trees are small: lists beat tensor ops here
    if plist[0] != -1:
        return f"node 0 (the root) must have parent -1, got {plist[0]}"
    for i in range(1, n):
        if not 0 <= plist[i] < i:
            return f"node {i} has parent {plist[i]}; parents must point to an earlier node (0 <= parent < {i})"
    for i, t in enumerate(tlist):
        if not 0 <= t < vocab:
            return f"node {i} holds token {t}, outside the target's vocabulary [0, {vocab})"
    return None


def depths(parents: torch.Tensor) -> torch.Tensor:
    """parents: [n] long -> depth of each node: [n] long (root = 0)."""
    plist = parents.tolist()
    out = [0] * len(plist)
    for i, p in enumerate(plist[1:], start=1):
        out[i] = out[p] + 1
    return torch.tensor(out, dtype=torch.long, device=parents.device)


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """parents: [n] long -> mask [n, n] bool; mask[i, j] is True when j is i or an ancestor of i."""
    n = parents.shape[0]
    plist = parents.tolist()
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(plist):
        if p >= 0:
            mask[i] = mask[p]
        mask[i, i] = True
    return mask.to(parents.device)


def leaf_paths(parents: list[int]) -> list[list[int]]:
    """Every root-to-leaf path, as lists of node indices starting at 0."""
    has_child = [False] * len(parents)
    for p in parents[1:]:
        has_child[p] = True
    paths = []
    for leaf, child in enumerate(has_child):
        if child:
            continue
        path = [leaf]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        paths.append(path[::-1])
    return paths


def children(parents: list[int]) -> list[list[int]]:
    """children[i] = the nodes whose parent is i, in index order."""
    out: list[list[int]] = [[] for _ in parents]
    for i, p in enumerate(parents[1:], start=1):
        out[p].append(i)
    return out
