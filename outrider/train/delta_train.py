"""A gated-delta mixer that trains: the same computation as models/delta_layer.py's `delta_mixer`
on a plain causal prefill from a zero state, batched and differentiable in float32, its weights
under the names weights/loader.py `_delta_layer` reads, and its start from an attention layer.

    mixer = DeltaMixer.from_attention(q_proj, k_proj, v_proj, o_proj, heads, kv_heads, eps, h_mean)
    y = mixer(h)                 # h [B, T, E] normed layer input -> [B, T, E]
    mixer.tensors("model.layers.3.")   # {Hugging Face name: tensor} for a safetensors file

`chunked_train` is the chunked WY form of the gated delta rule (models/gated_delta.py states the
algebra) over [B, H, T, ...] in float32, with autograd through the triangular solve; it is tested
against `gated_delta.recurrent_reference` (tests/test_delta_distill.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..models.config import DeltaConfig


def chunked_train(q, k, v, g, beta, chunk: int = 64):
    """q, k [B, H, T, dk] (normed, q scaled), v [B, H, T, dv], g, beta [B, H, T] -> o [B, H, T, dv],
    from a zero state. Chunks are solved at once (one batched triangular solve), then the state is
    carried across chunks in order."""
    B, H, T, dk = q.shape
    dv = v.shape[-1]
    pad = (-T) % chunk
    if pad:  # zero tokens after the end: no effect on the real ones (causal)
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    N = q.shape[2] // chunk
    q, k, v = (t.reshape(B, H, N, chunk, -1) for t in (q, k, v))  # [B, H, N, C, d]
    g, beta = g.reshape(B, H, N, chunk), beta.reshape(B, H, N, chunk)
    G = g.cumsum(-1)  # [B, H, N, C] log-decay from the chunk's start, token included
    strict = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril(-1)
    incl = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    diff = G[..., :, None] - G[..., None, :]  # [B, H, N, C, C]
    decay_strict = diff.masked_fill(~strict, -math.inf).exp()
    decay_incl = diff.masked_fill(~incl, -math.inf).exp()
    A = beta[..., None] * decay_strict * (k @ k.transpose(-1, -2))  # strictly lower
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    rhs = torch.cat((beta[..., None] * v, beta[..., None] * G.exp()[..., None] * k), -1)  # [.., C, dv + dk]
    solved = torch.linalg.solve_triangular(A + eye, rhs, upper=False, unitriangular=True)
    Wv, Wk = solved.split([dv, dk], -1)  # u = Wv - Wk S
    qk = decay_incl * (q @ k.transpose(-1, -2))  # [B, H, N, C, C]
    last = G[..., -1:]  # [B, H, N, 1]
    k_to_end = k * (last - G).exp()[..., None]  # [B, H, N, C, dk]
    S = q.new_zeros(B, H, dk, dv)
    outs = []
    for n in range(N):
        U = Wv[:, :, n] - Wk[:, :, n] @ S  # [B, H, C, dv]
        outs.append(G[:, :, n].exp()[..., None] * (q[:, :, n] @ S) + qk[:, :, n] @ U)
        S = last[:, :, n, :, None].exp() * S + k_to_end[:, :, n].transpose(-1, -2) @ U
    return torch.stack(outs, 2).reshape(B, H, N * chunk, dv)[:, :, :T]


def _inverse_softplus(x: torch.Tensor) -> torch.Tensor:
    return x + torch.log(-torch.expm1(-x))


class DeltaMixer(nn.Module):
    def __init__(self, hidden: int, cfg: DeltaConfig, eps: float):
        super().__init__()
        self.cfg, self.eps = cfg, eps
        HK, HV, dk, dv, K = cfg.num_k_heads, cfg.num_v_heads, cfg.k_head_dim, cfg.v_head_dim, cfg.conv_kernel
        self.in_qkv = nn.Parameter(torch.zeros(cfg.conv_dim, hidden))
        self.in_z = nn.Parameter(torch.zeros(HV * dv, hidden))
        self.in_b = nn.Parameter(torch.zeros(HV, hidden))
        self.in_a = nn.Parameter(torch.zeros(HV, hidden))
        self.conv = nn.Parameter(torch.zeros(cfg.conv_dim, K))  # taps, oldest input first
        self.A_log = nn.Parameter(torch.zeros(HV))
        self.dt_bias = nn.Parameter(torch.zeros(HV))
        self.norm = nn.Parameter(torch.ones(dv))
        self.out = nn.Parameter(torch.zeros(hidden, HV * dv))

    @staticmethod
    def from_attention(q_proj, k_proj, v_proj, o_proj, heads: int, kv_heads: int, cfg: DeltaConfig, eps: float,
                       h_mean: torch.Tensor, gate: float = 3.0, v_scale: float = 0.25) -> "DeltaMixer":
        """Start from an attention layer (weights [out, in], Hugging Face layout) with kv_heads ==
        num_k_heads == num_v_heads and dk == dv == head_dim: per KV group, q = the mean of its query
        heads' rows, k, v = that group's K and V rows, out = the sum of its query heads' o_proj
        column blocks. The convolution starts as the identity times `v_scale` (silu is about
        linear there: silu(s x) ~ s x / 2), the output gate as silu(z) ~ silu(gate) on an average
        input (z's rows along `h_mean`, the mean normed input), beta at 1/2, and the decays spread
        over the heads from slow to fast (Gated DeltaNet's dt range 0.001 .. 0.1)."""
        HK, dk = cfg.num_k_heads, cfg.k_head_dim
        if not (kv_heads == HK == cfg.num_v_heads and dk == cfg.v_head_dim == q_proj.shape[0] // heads):
            raise ValueError("from_attention wants one gated-delta head per KV head, of the same size")
        E = q_proj.shape[1]
        m = DeltaMixer(E, cfg, eps)
        group = heads // kv_heads
        with torch.no_grad():
            q = q_proj.float().view(kv_heads, group, dk, E).mean(1).reshape(HK * dk, E)
            m.in_qkv.copy_(torch.cat((q, k_proj.float(), v_proj.float())))
            m.out.copy_(o_proj.float().view(E, kv_heads, group, dk).sum(2).reshape(E, HK * dk))
            m.conv[:, -1] = v_scale
            direction = h_mean.float() / h_mean.float().pow(2).sum()
            m.in_z.copy_(gate * direction.expand_as(m.in_z))
            dt = torch.logspace(math.log10(0.001), math.log10(0.1), cfg.num_v_heads)
            m.dt_bias.copy_(_inverse_softplus(dt))
        return m

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h [B, T, E] (the layer's normed input) -> [B, T, E], from a zero state (float32)."""
        cfg = self.cfg
        B, T, E = h.shape
        HK, HV, dk, dv, K = cfg.num_k_heads, cfg.num_v_heads, cfg.k_head_dim, cfg.v_head_dim, cfg.conv_kernel
        h = h.float()
        x = h @ self.in_qkv.T  # [B, T, C]
        x = F.silu(F.conv1d(F.pad(x.transpose(1, 2), (K - 1, 0)), self.conv.unsqueeze(1), groups=x.shape[-1]))
        q, k, v = x.transpose(1, 2).split([HK * dk, HK * dk, HV * dv], -1)
        q = F.normalize(q.reshape(B, T, HK, dk), dim=-1, eps=1e-6).repeat_interleave(HV // HK, 2) * dk ** -0.5
        k = F.normalize(k.reshape(B, T, HK, dk), dim=-1, eps=1e-6).repeat_interleave(HV // HK, 2)
        v = v.reshape(B, T, HV, dv)
        beta = torch.sigmoid(h @ self.in_b.T)  # [B, T, HV]
        g = -self.A_log.exp() * F.softplus(h @ self.in_a.T + self.dt_bias)
        o = chunked_train(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), g.transpose(1, 2),
                          beta.transpose(1, 2)).transpose(1, 2)  # [B, T, HV, dv]
        z = (h @ self.in_z.T).view(B, T, HV, dv)
        o = F.rms_norm(o, (dv,), self.norm, self.eps) * F.silu(z)
        return o.reshape(B, T, HV * dv) @ self.out.T

    def tensors(self, prefix: str, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """The weights under weights/loader.py `_delta_layer`'s names (prefix "model.layers.i.")."""
        p, HV, dv = prefix + "linear_attn.", self.cfg.num_v_heads, self.cfg.v_head_dim
        w = {"in_proj_qkv.weight": self.in_qkv, "in_proj_z.weight": self.in_z, "in_proj_b.weight": self.in_b,
             "in_proj_a.weight": self.in_a, "conv1d.weight": self.conv.unsqueeze(1), "A_log": self.A_log,
             "dt_bias": self.dt_bias, "norm.weight": self.norm, "out_proj.weight": self.out}
        return {p + name: t.detach().to(dtype).contiguous() for name, t in w.items()}
