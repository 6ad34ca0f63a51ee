"""GLANCE's draftability law (docs/methods.md#glance): acceptance against the target's next-token entropy.

Each round gives one point: H, the entropy (nats) of the target's next-token distribution at the
round's root (the committed token the round drafts after), and a, the drafts the round accepted
(tau - 1). GLANCE models each block offset as a Bernoulli match with

    logit p = b0 - b1 * H        so   E[a | H] = min(p / (1 - p), L) = min(exp(b0 - b1 * H), L)

(the geometric run's mean, capped at the block's reach L = B - 1; the paper's code form, its
README writes p(1 - p^L)/(1 - p)). b0 and b1 are fitted per workload by least squares over the
rounds (`fit_law`, Levenberg-Marquardt on two parameters). A steeper b1 means acceptance is set by
how sure the target is: the paper finds b1 grows with grounding (copying from the context).

The fit is reported with GLANCE's four checks (`LawFit.checks`): b1 > 0; a negative and
significant rank correlation of a with H; the entropy-decile means fit (R^2 >= 0.5) or the
round-level R^2 reaches half of what any function of H could explain (the "ceiling", between-bin
variance over 50 quantile bins); mean acceptance >= 0.15 and b1 <= 25 (not degenerate). Beside
them, a held-out check this project adds (`held_out`): fit on half the prompts, predict the other
half's rounds and decile means, against predicting their mean acceptance (a constant).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


def expected_accepted(entropy, b0: float, b1: float, cap: float) -> np.ndarray:
    """E[a | H] = min(exp(b0 - b1 H), cap), elementwise. entropy: [n] nats."""
    return np.minimum(np.exp(np.clip(b0 - b1 * np.asarray(entropy, float), -60.0, 60.0)), cap)


def expected_accepted_slow(entropy: float, b0: float, b1: float, cap: float) -> float:
    """The same for one round, through p itself (the reference for the vectorized form)."""
    p = 1.0 / (1.0 + math.exp(-(b0 - b1 * entropy)))
    return min(p / (1.0 - p), cap)


def r2(y: np.ndarray, pred: np.ndarray) -> float:
    total = float(((y - y.mean()) ** 2).sum())
    return float("nan") if total <= 0 else 1.0 - float(((y - pred) ** 2).sum()) / total


def quantile_bins(entropy: np.ndarray, bins: int) -> list[np.ndarray]:
    """Indices of the rounds in each entropy quantile bin (empty bins dropped)."""
    edges = np.quantile(entropy, np.linspace(0, 1, bins + 1))
    edges[0], edges[-1] = -np.inf, np.inf
    out = [np.nonzero((entropy >= lo) & (entropy < hi))[0] for lo, hi in zip(edges[:-1], edges[1:])]
    return [i for i in out if i.size]


def decile_curve(entropy: np.ndarray, accepted: np.ndarray, bins: int = 10) -> list[tuple[float, float, int]]:
    """(mean H, mean a, rounds) per entropy decile: the law read off the data."""
    return [(float(entropy[i].mean()), float(accepted[i].mean()), int(i.size)) for i in quantile_bins(entropy, bins)]


def entropy_ceiling(entropy: np.ndarray, accepted: np.ndarray, bins: int = 50) -> float:
    """The share of the rounds' variance a function of H alone could explain: between-bin over
    total variance on fine quantile bins."""
    bins = bins if accepted.size >= 2 * bins else max(5, accepted.size // 10)
    total = float(((accepted - accepted.mean()) ** 2).sum())
    between = sum(i.size * (accepted[i].mean() - accepted.mean()) ** 2 for i in quantile_bins(entropy, bins))
    return float(between / total) if total > 0 else float("nan")


def spearman(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Spearman's rho (average ranks for ties) and its two-sided p-value (t approximation)."""
    def ranks(v):
        order = np.argsort(v, kind="mergesort")
        r = np.empty(v.size)
        r[order] = np.arange(v.size)
        for value in np.unique(v):  # ties share their mean rank
            at = v == value
            if at.sum() > 1:
                r[at] = r[at].mean()
        return r

    rx, ry = ranks(np.asarray(x, float)), ranks(np.asarray(y, float))
    if rx.std() == 0 or ry.std() == 0:
        return float("nan"), float("nan")
    rho = float(np.corrcoef(rx, ry)[0, 1])
    n = x.size
    t = rho * math.sqrt(max(n - 2, 1) / max(1e-12, 1 - rho * rho))
    return rho, math.erfc(abs(t) / math.sqrt(2))  # normal tail of t: n is hundreds of rounds here


@dataclass
class LawFit:
    b0: float
    b1: float
    cap: float
    n: int
    mean_accepted: float
    r2_curve: float  # against the decile means
    r2_round: float  # against single rounds
    r2_ceiling: float  # the most a function of H could reach on single rounds
    spearman_rho: float
    spearman_p: float
    curve: list = field(default_factory=list)

    def checks(self) -> dict[str, bool]:
        """GLANCE's four conditions (module notes); the law holds when all are True."""
        share = self.r2_round / self.r2_ceiling if self.r2_ceiling and self.r2_ceiling > 0 else float("nan")
        return {
            "slope_positive": self.b1 > 0,
            "negative_rank_correlation": self.spearman_rho < 0 and self.spearman_p < 0.05,
            "curve_or_ceiling": (self.r2_curve >= 0.5) or (share >= 0.5),
            "non_degenerate": self.mean_accepted >= 0.15 and self.b1 <= 25.0,
        }

    def holds(self) -> bool:
        return all(self.checks().values())

    def predict(self, entropy) -> np.ndarray:
        return expected_accepted(entropy, self.b0, self.b1, self.cap)


def fit_law(entropy, accepted, cap: float, bins: int = 10, iterations: int = 200) -> LawFit:
    """b0, b1 by least squares over the rounds (Levenberg-Marquardt), with the diagnostics.
    entropy: [n] nats at each round's root; accepted: [n] drafts accepted that round."""
    H, a = np.asarray(entropy, float), np.asarray(accepted, float)
    if H.size < 30 or H.std() == 0 or a.std() == 0:
        raise ValueError(f"the law needs at least 30 rounds with variation in both H and a, got {H.size}")
    theta = np.array([math.log(max(float(a.mean()), 0.05)), 1.0])  # start: a flat law at the mean
    damping = 1e-3

    def loss(t):
        return float(((expected_accepted(H, t[0], t[1], cap) - a) ** 2).sum())

    current = loss(theta)
    for _ in range(iterations):
        raw = np.exp(np.clip(theta[0] - theta[1] * H, -60.0, 60.0))
        free = raw < cap  # capped rounds do not move with the parameters
        J = np.stack([raw * free, -H * raw * free], axis=1)  # [n, 2] d E / d (b0, b1)
        resid = np.minimum(raw, cap) - a
        A, g = J.T @ J, J.T @ resid
        step = np.linalg.solve(A + damping * np.diag(np.diag(A) + 1e-9), -g)
        trial = loss(theta + step)
        if trial < current:
            theta, current, damping = theta + step, trial, damping / 3
            if abs(step).max() < 1e-9:
                break
        else:
            damping *= 4
            if damping > 1e9:
                break
    b0, b1 = float(theta[0]), float(theta[1])
    curve = decile_curve(H, a, bins)
    ch = np.array([c[0] for c in curve]), np.array([c[1] for c in curve])
    rho, p = spearman(H, a)
    return LawFit(b0, b1, cap, int(H.size), float(a.mean()),
                  r2(ch[1], expected_accepted(ch[0], b0, b1, cap)) if len(curve) > 1 else float("nan"),
                  r2(a, expected_accepted(H, b0, b1, cap)), entropy_ceiling(H, a), rho, p, curve)


@dataclass
class HeldOut:
    r2_round: float  # the other half's rounds, predicted by the law fitted on one half
    r2_curve: float  # the other half's decile means
    mse_law: float
    mse_constant: float  # predicting the fitting half's mean acceptance for every round

    @property
    def beats_constant(self) -> bool:
        return self.mse_law < self.mse_constant


def held_out(fit: LawFit, entropy, accepted, train_mean: float, bins: int = 10) -> HeldOut:
    """How a law fitted on other prompts predicts these rounds (fit: LawFit of the fitting half)."""
    H, a = np.asarray(entropy, float), np.asarray(accepted, float)
    pred = fit.predict(H)
    curve = decile_curve(H, a, bins)
    ch, ca = np.array([c[0] for c in curve]), np.array([c[1] for c in curve])
    return HeldOut(r2(a, pred), r2(ca, fit.predict(ch)) if len(curve) > 1 else float("nan"),
                   float(((pred - a) ** 2).mean()), float(((train_mean - a) ** 2).mean()))
