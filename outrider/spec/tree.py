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


def check_parents(parents: list[int]) -> None:
    if not parents or parents[0] != -1:
        raise ValueError(f"a draft tree starts at its root (parents[0] == -1), got {parents[:4]}")
    for i, p in enumerate(parents[1:], start=1):
        if not 0 <= p < i:
            raise ValueError(f"node {i} has parent {p}; parents must point to an earlier node")


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
