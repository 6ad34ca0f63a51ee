"""The mixture-of-experts MLP (the sparse block of Qwen2-MoE, Qwen3-MoE, Qwen3-Next), in plain torch:
the reference every faster path (issue 41: experts in the native quantized kernels) is held to.

    x [M, E] -> router logits [M, N] -> softmax -> top k -> (renormalised) weights [M, k]
    out[m] = sum over m's chosen experts e of weight(m, e) * SwiGLU_e(x[m])
             + sigmoid(x[m] . shared_gate) * SwiGLU_shared(x[m])            (Qwen's shared expert)

Shapes: M rows (a forward's B * T tokens), E hidden size, N routed experts, k chosen per row,
I the expert size. The experts run one at a time on the rows that chose them (gathered, multiplied,
scattered back weighted), in expert order: a verify of many rows reads each chosen expert once.
Which rows chose which expert is read to the host once a layer (the count per expert): the
gathers need their sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .layers import linear, swiglu_mlp
from .moe_config import MoeConfig


@dataclass
class MoeWeights:
    router: torch.Tensor  # [N, E] float: the router's logits are x . router[e]
    gate_up: list  # N x [2I, E]: each expert's gate rows then up rows (a float tensor or a QuantLinear)
    down: list  # N x [E, I]
    shared_gate_up: object | None = None  # [2I_s, E]: the shared expert (None: no shared expert)
    shared_down: object | None = None  # [E, I_s]
    shared_gate: torch.Tensor | None = None  # [1, E]: the shared expert's output times sigmoid(x . w)

    @property
    def matrices(self) -> list:
        """Its projection weights (what the CPU product paths are measured on)."""
        shared = [m for m in (self.shared_gate_up, self.shared_down, self.shared_gate) if m is not None]
        return [self.router, *self.gate_up, *self.down, *shared]


def route(x: torch.Tensor, router: torch.Tensor, cfg: MoeConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, E] -> (weights [M, k] in x's dtype, experts [M, k] long): the k most probable experts
    of each row, their probabilities computed in float32 (renormalised over the k when
    cfg.norm_topk_prob), in descending order."""
    logits = linear(x, router)  # [M, N]
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [M, N]
    top, experts = torch.topk(probs, cfg.top_k, dim=-1)  # [M, k], [M, k]
    if cfg.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(x.dtype), experts


def moe_mlp(w: MoeWeights, cfg: MoeConfig, x: torch.Tensor) -> torch.Tensor:
    """x [B, T, E] (normed) -> the MoE MLP's output [B, T, E]."""
    flat = x.reshape(-1, x.shape[-1])  # [M, E]
    weights, experts = route(flat, w.router, cfg)  # [M, k], [M, k]
    k = experts.shape[1]
    chosen = experts.reshape(-1)  # [M k]: row m's j-th choice at m * k + j
    order = torch.argsort(chosen, stable=True)  # [M k]: the choices grouped by expert, rows ascending
    rows = order // k  # [M k]: the row of each grouped choice
    scale = weights.reshape(-1).index_select(0, order)  # [M k]
    counts = torch.bincount(chosen, minlength=cfg.num_experts).tolist()  # the layer's one host read
    out = torch.zeros_like(flat)  # [M, E]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        at = rows[start: start + n]  # [n] the rows that chose expert e
        y = swiglu_mlp(flat.index_select(0, at), w.gate_up[e], w.down[e])  # [n, E]
        out.index_add_(0, at, y * scale[start: start + n, None])
        start += n
    if w.shared_gate_up is not None:
        shared = swiglu_mlp(flat, w.shared_gate_up, w.shared_down)  # [M, E]
        if w.shared_gate is not None:
            shared = torch.sigmoid(linear(flat, w.shared_gate)) * shared  # [M, 1] * [M, E]
        out = out + shared
    return out.reshape(x.shape)
