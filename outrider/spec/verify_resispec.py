"""ResiSpec's residual shaping for sampled siblings, as we read it: LOSSY, never chosen by default.

The paper's point (issue 26, item 5): with k siblings drawn from q, multi-draft recursive
rejection sampling (verify_multidraft.py) replaces p by the residual norm(max(p - q, 0)) after
each rejection. That residual has no mass where q >= p, where the draft is confident, so it
drifts away from the draft distribution and the later siblings, drawn from (nearly) the same q,
are rarely accepted. ResiSpec reshapes the residual after each rejection to keep mass where the
draft is confident. We could not read the paper's rule (docs/methods.md#resispec); ours mixes
the residual with the overlap of p and the next sibling's distribution q':

    accept sibling x with probability min(1, p(x) / q(x))                  (as multi-draft RRS)
    on rejection  q' = q (with replacement) or q without x, renormalised (without)
                  p <- (1 - s) norm(max(p - q, 0)) + s norm(min(p, q'))       (RRS: s = 0)
                  q <- q'
    all rejected, or no children: commit y ~ p and stop

s = `shaping` (0.5 registered). The second part puts back mass where the next draft is likely
and p allows it, so the next sibling's acceptance, sum min(p, q'), rises. It is not exact, and
no rule that does this can be: if the siblings still to try owe the law r at this position, a
test accepting x with probability a(x) commits q(x) a(x) of x and leaves r - q a owed, so
q a <= r. RRS accepts the most, a = min(1, r / q), and leaves exactly max(r - q, 0) owed, nothing
where q >= r. Accepting as much and then keeping mass there as well commits the draft's confident
tokens too often; keeping that mass exactly would mean accepting less of them now. The exact
enumeration (tests/test_resispec.py) measures how far: docs/methods.md#resispec. Registered as
`resispec-lossy` (siblings without replacement, as `--tree sampled:...` draws them), chosen only
by name (`--verifier resispec-lossy`), kept out of the lossless tests.
"""

from __future__ import annotations

import torch

from .verify_chain import residual
from .verify_multidraft import MultiDraftVerifier

DEFAULT_SHAPING = 0.5  # the share of the reshaped residual put where the next draft is confident


class ResiSpecVerifier(MultiDraftVerifier):
    """Multi-draft rejection sampling whose residual after a rejection is mixed with norm(min(p, q'))."""

    def __init__(self, without_replacement: bool, shaping: float = DEFAULT_SHAPING) -> None:
        if not 0.0 <= shaping <= 1.0:
            raise ValueError(f"resispec shaping must be in [0, 1], got {shaping!r}")
        super().__init__(without_replacement)
        self.shaping = shaping

    def _residual(self, p: torch.Tensor, q: torch.Tensor, q_next: torch.Tensor) -> torch.Tensor:
        r = residual(p, q)  # [vocab]
        overlap = torch.minimum(p, q_next)  # [vocab]
        mass = float(overlap.sum())
        if self.shaping == 0.0 or mass <= 0.0:
            return r
        return (1.0 - self.shaping) * r + self.shaping * overlap / mass
