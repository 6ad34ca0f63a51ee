"""DSpark's hardware-aware prefix scheduler (the paper's Algorithm 1), and the slow reference it is tested against.

A round r drafted a chain whose positions have survival a_{r,j} = c_{r,1} ... c_{r,j} (the
calibrated confidence head's chance that positions 1..j are all accepted). Verifying R rounds
with d_r drafts each is one target step over B = sum_r (1 + d_r) tokens, expected to commit
tau = sum_r (1 + sum_{j <= d_r} a_{r,j}) tokens, at SPS(B) steps per second (a measured curve:
1 / the target's forward time over B new tokens, control/profile.py). The scheduler sorts every
(r, j) pair by a_{r,j}, highest first, and admits them one by one while Theta = tau * SPS(B)
keeps rising; it stops at the first pair that would not raise it (no look-ahead). Survival never
rises along a chain, so the admitted pairs are a prefix of every round's chain: it returns d_r.
"""

from __future__ import annotations

from typing import Callable


def admit(survival: list[list[float]], sps: Callable[[int], float]) -> list[int]:
    """survival[r]: [a_{r,1}, ..., a_{r,D_r}] non-increasing; sps(B) steps per second at B
    tokens -> the admitted depth d_r of each round (0 .. D_r)."""
    pairs = sorted(((a, r, j) for r, row in enumerate(survival) for j, a in enumerate(row)),
                   key=lambda p: (-p[0], p[1], p[2]))
    depth = [0] * len(survival)
    tau = float(len(survival))  # every round commits at least its bonus token
    tokens = len(survival)  # every round verifies its root
    best = tau * sps(tokens)
    for a, r, j in pairs:
        if j != depth[r]:  # a later position of a chain before its parent: never, as survival does not rise
            continue
        theta = (tau + a) * sps(tokens + 1)
        if theta <= best:
            break
        tau, tokens, best = tau + a, tokens + 1, theta
        depth[r] += 1
    return depth


def admit_reference(survival: list[list[float]], sps: Callable[[int], float]) -> list[int]:
    """The same rule written out slowly: at each step try every round's next position, take the
    one of highest survival (ties: the lower round), stop when Theta would not rise."""
    depth = [0] * len(survival)
    theta = lambda d: (len(d) + sum(sum(row[:k]) for row, k in zip(survival, d))) * sps(len(d) + sum(d))  # noqa: E731
    while True:
        options = [(survival[r][depth[r]], -r) for r in range(len(survival)) if depth[r] < len(survival[r])]
        if not options:
            return depth
        _, neg = max(options)
        trial = list(depth)
        trial[-neg] += 1
        if theta(trial) <= theta(depth):
            return depth
        depth = trial
