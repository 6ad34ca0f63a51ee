"""Sampled siblings: k children of one tree node drawn from q without replacement (`--tree sampled:...`).

Sibling j is drawn from q with siblings 0..j-1 removed and renormalised, the mode
`multidraft_without_replacement` verifies (spec/verify_multidraft.py). Draws come from the
request's drafting streams at the position the siblings decide (`offset`), one index per sibling,
so siblings at one depth of different parents share their uniforms: a verifier walks one node
per depth, so it never sees two of them.

When q has fewer than k tokens of positive mass, drawing stops when it is spent: fewer siblings,
each still a draw from what was left of q (the verifier then draws from its residual).

Each sibling's path confidence (DraftTree.confidence) is the parent's times q(x) of the drawn
token, q as the drafter gave it (not renormalised).
"""

from __future__ import annotations

import torch

from ..spec.random import Random


def draw_siblings(q: torch.Tensor, k: int, rng: Random, offset: int) -> list[tuple[int, float]]:
    """Up to k (token, q(token)) drawn from q [vocab] without replacement, in draw order."""
    left = q.double().clone()
    out: list[tuple[int, float]] = []
    for j in range(k):
        if not float(left.sum()) > 0.0:
            break
        x = rng.categorical(left, offset=offset, index=j)
        out.append((x, float(q[x])))
        left[x] = 0.0
    return out
