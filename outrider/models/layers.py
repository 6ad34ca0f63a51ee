"""The arithmetic of a decoder layer, as plain functions over weight tensors.

Shapes: B slots, T new tokens per slot, H query heads, G kv heads, D head dim, E hidden size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import cpu_linear


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., in], weight: [out, in] -> [..., out]: F.linear, by the CPU's fastest path here.

    On the CPU the BLAS reads a weight at very different speeds for few rows depending on the
    path and the machine, so `cpu_linear.matmul` uses the path measured fastest on this machine
    for the weight's shape and the row count (F.linear, `weight @ x.T`, or MKL's packed weight);
    each equals F.linear within float rounding (tests/test_cpu_linear.py). On CUDA this is plain
    F.linear. A weight kept quantized (quant_linear.QuantLinear) does its own product:
    `weight.linear(x, bias)`.
    """
    if not isinstance(weight, torch.Tensor):
        return weight.linear(x, bias)
    if x.device.type != "cpu":
        return F.linear(x, weight, bias)
    flat = x.reshape(-1, x.shape[-1])  # [M, in]
    return cpu_linear.matmul(flat, weight, bias).reshape(*x.shape[:-1], weight.shape[0])


def embedding(tokens: torch.Tensor, table) -> torch.Tensor:
    """tokens: [B, T] long -> [B, T, E]; `table` is [vocab, E] or quantized blocks (`lookup`)."""
    if isinstance(table, torch.Tensor):
        return F.embedding(tokens, table)
    return table.lookup(tokens)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., E] -> [..., E]; computed in float32 like the reference implementations."""
    if x.dtype == torch.float32:  # the fused kernel: same result, fewer ops
        return F.rms_norm(x, weight.shape, weight, eps)
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rotary_tables(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, scale: float = 1.0):
    """positions: [B, T] long, inv_freq: [D/2] -> cos, sin: [B, 1, T, D] (half-split layout), times
    `scale` (YaRN's attention factor; models/rope.py)."""
    freqs = positions.unsqueeze(-1).float() * inv_freq  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)  # [B, 1, T, D]
    if scale != 1.0:
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, D] -> same; rotates the two halves of each head."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def swiglu_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """x: [B, T, E], gate_up: [2I, E] (gate rows then up rows), down: [E, I] -> [B, T, E]."""
    gate, up = linear(x, gate_up).chunk(2, dim=-1)
    return linear(F.silu(gate) * up, down)


def gated_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """swiglu_mlp with the gate's activation named: "silu", or "gelu_tanh" (GELU's tanh
    approximation, Gemma's `gelu_pytorch_tanh`)."""
    if activation == "silu":
        return swiglu_mlp(x, gate_up, down)
    if activation != "gelu_tanh":
        raise ValueError(f"unknown MLP activation {activation!r}")
    gate, up = linear(x, gate_up).chunk(2, dim=-1)
    return linear(F.gelu(gate, approximate="tanh") * up, down)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    folded: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """q: [B, H, T, D], k: [B, G, L, D], v: [B, G, L, Dv], mask: [B, 1, T, L] bool or None -> [B, H, T, Dv]
    (Dv is D but for latent attention's absorbed form, models/latent_layer.py).

    mask None means one slot whose new tokens are the last T of L, causal among themselves.
    folded: `fold_mask(mask, H // G, q.dtype)`, made once per forward for every layer (else each
    call folds the mask itself, and SDPA turns the bool mask into this float one again).
    scale: the scores' scale (None: D ** -0.5; Gemma's query_pre_attn_scalar ** -0.5).
    """
    B, H, T, D = q.shape
    G, L = k.shape[1], k.shape[2]
    groups = H // G
    if mask is None and T > 1:
        if T != L:
            raise ValueError("a causal run without a mask must start at an empty cache")
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    # Fold each kv head's query heads into the token axis instead of copying K/V per head:
    # query head h = g * groups + j reads kv head g (the layout of grouped-query attention).
    q = q.reshape(B, G, groups * T, D)
    if mask is not None and folded is None:
        folded = fold_mask(mask, groups, q.dtype)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=folded, scale=scale)  # [B, G, groups*T, Dv]
    return out.reshape(B, H, T, v.shape[-1])


def fold_mask(mask: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """mask: [B, 1, T, L] bool -> [B, 1, groups * T, L] additive (0 where seen, -inf elsewhere):
    the mask of `attention`'s folded queries, in the form SDPA turns a bool mask into."""
    B, _, T, L = mask.shape
    mask = mask.unsqueeze(2).expand(B, 1, groups, T, L).reshape(B, 1, groups * T, L)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
