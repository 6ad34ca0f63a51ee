"""FunctionalMLA's reconstruction (seed #24): each converted latent-attention layer (mla_convert.py)
trained alone to reproduce its source attention's output after o_proj on calibration inputs,

    min over the MLA layer's weights of  || Attn_MLA(X_l) - Attn_source(X_l) ||^2

where X_l is the source model's own normed input to layer l on calibration text (its residual
stream, every layer from the same source pass). The converted shapes stay (rank, rotated
dimensions, the cache a token keeps); no target logits are read. Adam on the mean squared error,
reported as nmse (the error over the target's mean square) on held-out sequences before and after.

    source_attention(w, x, sizes)      the source's grouped-query attention (Q/K/V biases, RoPE on halves)
    MlaAttention(w, sizes, mla_raw)    a converted layer as a trainable module (the plain form, causal
                                       from position 0); .tensors() gives its weights back by name
    reconstruct(layer, x, ...)         one layer's training; returns (nmse before, nmse after)

These are slow-path float32 modules for training; the runtime's forward is models/latent_layer.py
(tests/test_mla_convert.py checks MlaAttention against it through the converted model's logits).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Sizes:
    heads: int  # H
    kv_heads: int  # G of the source
    head_dim: int  # D of the source
    theta: float  # the source's RoPE base


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """x [B, h, T, d] rotated by position from 0 (pairs (i, i + d/2))."""
    d, T = x.shape[-1], x.shape[2]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)  # [d/2]
    angles = torch.arange(T, dtype=torch.float32)[:, None] * inv[None]  # [T, d/2]
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    a, b = x.chunk(2, -1)
    return x * cos + torch.cat((-b, a), -1) * sin


def source_attention(w: dict, x: torch.Tensor, s: Sizes, rotated: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, T, E] (normed) -> the source attention's output after o_proj [B, T, E]; `w` holds
    q_proj.weight ... o_proj.weight (and q/k/v biases where the source has them). rotated: bool
    [D], the dimensions RoPE turns (None: all; a partial-RoPE source, what the conversion keeps)."""
    B, T, _ = x.shape
    H, G, D = s.heads, s.kv_heads, s.head_dim
    q = F.linear(x, w["q_proj.weight"], w.get("q_proj.bias")).view(B, T, H, D).transpose(1, 2)
    k = F.linear(x, w["k_proj.weight"], w.get("k_proj.bias")).view(B, T, G, D).transpose(1, 2)
    v = F.linear(x, w["v_proj.weight"], w.get("v_proj.bias")).view(B, T, G, D).transpose(1, 2)
    if rotated is None:
        q, k = _rope(q, s.theta), _rope(k, s.theta)
    else:
        q, k = torch.where(rotated, _rope(q, s.theta), q), torch.where(rotated, _rope(k, s.theta), k)
    o = F.scaled_dot_product_attention(q, k.repeat_interleave(H // G, 1), v.repeat_interleave(H // G, 1),
                                       is_causal=True)  # [B, H, T, D]
    return F.linear(o.transpose(1, 2).reshape(B, T, H * D), w["o_proj.weight"], w.get("o_proj.bias"))


class MlaAttention(torch.nn.Module):
    """A converted layer (names as mla_convert writes them) as trainable parameters."""

    def __init__(self, w: dict, raw: dict):
        super().__init__()
        self.names = sorted(w)
        self.params = torch.nn.ParameterDict({n.replace(".", "__"): torch.nn.Parameter(w[n].clone().float())
                                              for n in self.names})
        self.H = int(raw["num_attention_heads"])
        self.r, self.dn = int(raw["kv_lora_rank"]), int(raw["qk_nope_head_dim"])
        self.dr, self.dv = int(raw["qk_rope_head_dim"]), int(raw["v_head_dim"])
        self.R = int(raw.get("qk_rope_heads") or 1)
        self.theta = float(raw["rope_parameters"]["rope_theta"])

    def p(self, name: str):
        return self.params[name.replace(".", "__")] if name in self.names else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, E] (normed) -> [B, T, E]: the plain form, causal from position 0."""
        B, T, _ = x.shape
        H, r, dn, dr, dv, R = self.H, self.r, self.dn, self.dr, self.dv, self.R
        q = F.linear(x, self.p("q_proj.weight"), self.p("q_proj.bias")).view(B, T, H, dn + dr).transpose(1, 2)
        kv = F.linear(x, self.p("kv_a_proj_with_mqa.weight"), self.p("kv_a_proj_with_mqa.bias"))  # [B, T, r + R dr]
        k_pe = _rope(kv[..., r:].reshape(B, T, R, dr).transpose(1, 2), self.theta)  # [B, R, T, dr]
        up = F.linear(kv[..., :r], self.p("kv_b_proj.weight")).view(B, T, H, dn + dv).transpose(1, 2)
        keys = torch.cat((up[..., :dn], k_pe.repeat_interleave(H // R, 1)), -1)  # [B, H, T, dn + dr]
        query = torch.cat((q[..., :dn], _rope(q[..., dn:], self.theta)), -1)
        o = F.scaled_dot_product_attention(query, keys, up[..., dn:], is_causal=True)  # [B, H, T, dv]
        return F.linear(o.transpose(1, 2).reshape(B, T, H * dv), self.p("o_proj.weight"), self.p("o_proj.bias"))

    def tensors(self) -> dict:
        return {n: self.p(n).detach().clone().contiguous() for n in self.names}


def nmse(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got - want) ** 2).mean() / (want ** 2).mean())


def reconstruct(module: MlaAttention, x: torch.Tensor, y: torch.Tensor, x_val: torch.Tensor, y_val: torch.Tensor,
                *, steps: int, lr: float, batch: int, seed: int = 0) -> tuple[float, float]:
    """Adam on || module(x) - y ||^2 (x [N, T, E], y [N, T, E]) over `steps` minibatches of `batch`
    sequences (a seeded order), the learning rate decayed to 0 by a cosine; returns (held-out nmse
    before, after)."""
    with torch.no_grad():
        before = nmse(module(x_val), y_val)
    optimizer = torch.optim.Adam(module.parameters(), lr=lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda i: 0.5 * (1 + torch.cos(torch.tensor(torch.pi * i / max(steps, 1))).item()))
    scale = float((y ** 2).mean())
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        pick = torch.randperm(x.shape[0], generator=generator)[:batch]
        loss = ((module(x[pick]) - y[pick]) ** 2).mean() / scale
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    with torch.no_grad():
        after = nmse(module(x_val), y_val)
    return before, after
