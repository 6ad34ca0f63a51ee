"""The attention token mixer over a batch of slots (the torch reference; kernels/decoder_layer.py
runs the plain form natively): grouped-query attention with optional Q/K/V biases, RMS-normed
queries and keys, partial rotary embeddings and an output gate (Qwen3.5), writing each new
token's K/V to its cache row and reading the span of slots the batch covers (batch.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .layers import apply_rotary, attention, linear, rms_norm


@dataclass(frozen=True)
class SpanView:
    """What every attention layer of one forward shares: the mask (span rows when slots have holes)
    and its additive form folded for the query groups, made once."""

    mask: torch.Tensor | None  # [B or S, 1, T, L] bool
    folded: torch.Tensor | None
    place: torch.Tensor | None  # [B] long: batch row b's span row; None: b
    first: int
    span: int


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary: int) -> torch.Tensor:
    """x [B, heads, T, D]: the first `rotary` dimensions of each head rotated, the rest as they are."""
    if rotary == x.shape[-1]:
        return apply_rotary(x, cos, sin)
    return torch.cat((apply_rotary(x[..., :rotary], cos, sin), x[..., rotary:]), dim=-1)


def attention_mixer(w, c, h: torch.Tensor, batch, cache, index: int, cos, sin, view) -> torch.Tensor:
    """h [B, T, E] (normed) -> the attention's output projected back, [B, T, E]; writes K/V rows.
    view: the forward's SpanView over the cache, or a sliding layer's RingView over its ring
    (ring_attention.py), which writes and reads the rows itself."""
    B, T, _ = h.shape
    H, G, D, R = c.num_heads, c.num_kv_heads, c.head_dim, c.rotary
    qkv = linear(h, w.qkv, w.qkv_bias)  # [B, T, (H + 2G) * D]
    if c.qk_norm_whole:  # OLMoE: one norm over a token's H D queries, one over its G D keys, before heads
        qkv = torch.cat((rms_norm(qkv[..., : H * D], w.q_norm, c.rms_norm_eps),
                         rms_norm(qkv[..., H * D: (H + G) * D], w.k_norm, c.rms_norm_eps), qkv[..., (H + G) * D:]), dim=-1)
    v = qkv[..., (H + G) * D:].view(B, T, G, D)  # [B, T, G, D]
    if (w.q_norm is None or c.qk_norm_whole) and R == D:  # q and k rotated in one go: the same arithmetic, fewer ops
        qk = apply_rotary(qkv[..., : (H + G) * D].view(B, T, H + G, D).transpose(1, 2), cos, sin)
        q, k = qk[:, :H], qk[:, H:].transpose(1, 2)  # [B, H, T, D], [B, T, G, D]
    else:
        q = qkv[..., : H * D].view(B, T, H, D).transpose(1, 2)
        k = qkv[..., H * D: (H + G) * D].view(B, T, G, D).transpose(1, 2)
        if w.q_norm is not None and not c.qk_norm_whole:
            q, k = rms_norm(q, w.q_norm, c.rms_norm_eps), rms_norm(k, w.k_norm, c.rms_norm_eps)
        q = rotate(q, cos, sin, R)  # [B, H, T, D]
        k = rotate(k, cos, sin, R).transpose(1, 2)  # [B, T, G, D]
    scale = c.attn_scale or None  # the family's (Gemma 3's query_pre_attn_scalar ** -0.5), or SDPA's D ** -0.5
    if not isinstance(view, SpanView):  # a sliding layer kept in a ring: ring_attention.RingView
        return _project_out(w, h, view.attend(cache, index, batch, q, k, v, scale))
    kv = cache.kv if hasattr(cache, "kv") else cache  # a hybrid's attention layers: its KVCache
    layer = cache.attention_index(index) if hasattr(cache, "kv") else index
    kv.write(layer, batch.slots, batch.rows, k, v)
    keys, values = kv.span(layer, view.first, view.span, batch.kv_len)  # [S, G, L, D], views
    if keys.dtype != q.dtype:  # a float16 cache (kv_dtype): its values, widened exactly
        keys, values = keys.to(q.dtype), values.to(q.dtype)
    if view.place is None:
        out = attention(q, keys, values, view.mask, view.folded, scale)  # [B, H, T, D]
    else:  # slots with holes or out of order: queries go to their span rows (batch.py)
        q_span = q.new_zeros(view.span, H, T, D).index_copy_(0, view.place, q)  # [S, H, T, D]
        out = attention(q_span, keys, values, view.mask, view.folded, scale).index_select(0, view.place)  # [B, H, T, D]
    return _project_out(w, h, out)


def _project_out(w, h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The heads' outputs out [B, H, T, D] -> [B, T, E]: gated (Qwen3.5) and projected by o."""
    B, H, T, D = out.shape
    out = out.transpose(1, 2).reshape(B, T, H * D)
    if w.gate is not None:  # Qwen3.5: each head's output gated by sigmoid of its gate rows
        out = out * torch.sigmoid(linear(h, w.gate))
    return linear(out, w.o)
