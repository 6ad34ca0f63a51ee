"""S2-MoE's reuse-aware expert gating in verification (seed #9, card 2.9). LOSSY:
`--verifier s2moe-gate-lossy[:CAP][,lambda=A]`, off by default, refused by any other name
(docs/methods.md#s2-moe-reuse-aware-gating). Pairs with the lossless drafter `--drafter s2moe:K'`.

Per verify forward, tree and MoE layer, with l_b the router logits of node b (for a softmax router
log of its scores: the same order and differences) and w_b its draft path confidence (1 for the
root, and for every node of a tree without confidences):

    g       = sum over b of w_b * l_b                                   [N]
    E*      = the CAP experts of the best g (CAP >= k; default k)
    l'_b,e  = l_b,e + lambda_b * [e in E*],  lambda_b = A * (l_b's top-1 - l_b's (k+1)-th)
    node b chooses the top k of l'_b

so a node keeps an expert outside E* only where its own preference beats the bias. The chosen
experts weigh by their unbiased scores (renormalised where the model does): the card does not
say which the paper uses. A = 0, or CAP >= N (every expert in E*, every logit shifted alike),
is exact routing, bit for bit. The paper's fused CUDA kernel is a GPU matter; here the choice is
moe_layer.route's `allowed` set to each node's k biased choices.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from ..models.expert_select import Selection, verify_groups
from .verify_routed import RoutedGreedyVerifier

NAME = "s2moe-gate-lossy"
USAGE = "s2moe-gate-lossy[:CAP][,lambda=A]"
DEFAULT_LAMBDA = 1.0


def _confidence(tree) -> torch.Tensor:
    """[n]: the nodes' path confidences (1 where the drafter gives none)."""
    return tree.confidence.float() if tree.confidence is not None else torch.ones(tree.size)


class ReuseGate(Selection):
    """The biased choice of the module's notes. cap: CAP (None: the model's k); strength: A."""

    name = NAME

    def __init__(self, cap: int | None = None, strength: float = DEFAULT_LAMBDA):
        super().__init__()
        self.cap, self.strength = cap, strength

    def verify_rows(self, shape, trees, selected, device=None):
        return verify_groups(shape, trees, selected, lambda t: torch.zeros(t.size, dtype=torch.long), _confidence,
                             device)

    def allowed(self, key, w, cfg, scores, exact):
        k, n = cfg.top_k, cfg.num_experts
        cap = k if self.cap is None else max(self.cap, k)
        if self.strength == 0.0 or cap >= n:
            return None
        rows = self.rows
        tiny = torch.finfo(torch.float32).tiny
        logits = scores.clamp_min(tiny).log()  # [M, N]
        if cfg.scoring == "sigmoid":
            logits = logits - (1.0 - scores).clamp_min(tiny).log()
        inside = rows.group >= 0  # [M]
        g = torch.zeros(rows.groups, n, dtype=torch.float64, device=scores.device)
        g.index_add_(0, rows.group[inside], (logits[inside] * rows.weight[inside, None]).double())  # [G, N]
        best = torch.zeros(rows.groups, n, dtype=torch.bool, device=scores.device)
        best.scatter_(1, torch.topk(g, cap, dim=-1).indices, True)  # [G, N]: E*
        ranked = torch.topk(logits, min(k + 1, n), dim=-1).values  # [M, k + 1]
        margin = ranked[:, 0] - ranked[:, -1]  # [M]: top-1 minus (k+1)-th
        biased = logits + (self.strength * margin)[:, None] * best[rows.group.clamp(min=0)].float()  # [M, N]
        allowed = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, torch.topk(biased, k, dim=-1).indices, True)
        return allowed | ~inside[:, None]


def parse(argument: str) -> ReuseGate:
    """"" -> the defaults; "3" -> CAP 3; "3,lambda=0.5"."""
    cap, strength = None, DEFAULT_LAMBDA
    for i, part in enumerate(p for p in argument.split(",") if p):
        key, eq, value = part.partition("=")
        try:
            if not eq and i == 0:
                cap = int(part)
            elif key == "lambda":
                strength = float(value)
            else:
                raise ValueError
        except ValueError:
            raise ConfigError(f"--verifier {USAGE}: cannot read {part!r}") from None
    if (cap is not None and cap < 1) or strength < 0.0:
        raise ConfigError(f"--verifier {USAGE}: CAP must be at least 1 and A at least 0")
    return ReuseGate(cap, strength)


def verifier(argument: str) -> RoutedGreedyVerifier:
    return RoutedGreedyVerifier(parse(argument))
