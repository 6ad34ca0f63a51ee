"""DSpark's per-position temperature calibration: one temperature a position, fitted left to right
by a 1-D grid search minimising the expected calibration error (ECE) of the cumulative products.

The confidence head gives logits l_{i,k} (block i, position k = 1..gamma); the calibrated survival
is a_{i,k} = prod_{j <= k} sigmoid(l_{i,j} / T_j), and the event it predicts is "positions 1..k of
block i were all accepted" (alive_{i,k}). T_1 is chosen first (its ECE involves only itself), then
T_2 with T_1 fixed, and so on (the paper's sequential temperature scaling).

    temps = fit_temperatures(logits [N, G], alive [N, G] bool)       -> tuple of G floats
    ece(pred [N], hit [N] bool, bins=10)                             -> float
"""

from __future__ import annotations

import torch

GRID = tuple(sorted({1.0, *(round(0.25 * 1.1 ** i, 4) for i in range(40))}))  # 0.25 .. ~10, geometric, and 1


def ece(pred: torch.Tensor, hit: torch.Tensor, bins: int = 10) -> float:
    """Equal-width bins over [0, 1]: sum over bins of (share of rows) * |mean pred - hit rate|."""
    pred, hit = pred.double().flatten(), hit.double().flatten()
    if pred.numel() == 0:
        return 0.0
    which = (pred * bins).long().clamp(0, bins - 1)
    total = 0.0
    for b in range(bins):
        inside = which == b
        n = int(inside.sum())
        if n:
            total += n / pred.numel() * abs(float(pred[inside].mean() - hit[inside].mean()))
    return total


def fit_temperatures(logits: torch.Tensor, alive: torch.Tensor, grid=GRID, bins: int = 10) -> tuple[float, ...]:
    """logits [N, G] float, alive [N, G] bool (rows where position k was reached and accepted,
    with all before it) -> (T_1, ..., T_G), fitted left to right."""
    N, G = logits.shape
    survival = torch.ones(N, dtype=torch.float64)
    temps = []
    for k in range(G):
        best = None
        for t in grid:
            trial = survival * torch.sigmoid(logits[:, k].double() / t)
            score = ece(trial, alive[:, k], bins)
            if best is None or score < best[0] - 1e-12:
                best = (score, t)
        temps.append(float(best[1]))
        survival = survival * torch.sigmoid(logits[:, k].double() / best[1])
    return tuple(temps)
