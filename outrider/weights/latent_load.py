"""A latent-attention layer's weights under DeepSeek-V2's names (weights/loader.py reads one a
layer; models/latent_layer.py computes with them):

    self_attn.q_proj (or q_a_proj, q_a_layernorm, q_b_proj), kv_a_proj_with_mqa, kv_a_layernorm
    (absent in a converted model: mha2mla.py), kv_b_proj, o_proj; biases where present (a converted
    model's q_proj, kv_a_proj_with_mqa and o_proj)

q_proj's (or q_a_proj's) rows and kv_a_proj_with_mqa's are fused into one projection (both read
the layer's normed input). kv_b_proj is read as float whatever the load's quantization: the
absorbed form multiplies queries and outputs by its per-head blocks. Where the family turns RoPE
on interleaved pairs (DeepSeek-V2), each head's rotated rows are reordered into halves order
(dimensions 0, 2, 4, ..., then 1, 3, 5, ...), queries and keys alike, so that the runtime's
rotation of (i, i + dr / 2) is DeepSeek's rotation of (2i, 2i + 1): the same scores.
"""

from __future__ import annotations

import torch

from ..models.decoder import LayerWeights
from ..models.latent_layer import LatentWeights
from ..models.mla_config import MlaConfig
from .quant_load import RowStack


def halves(dim: int) -> torch.Tensor:
    """[dim] long: interleaved pairs' dimensions in halves order (0, 2, ..., dim - 2, 1, 3, ...)."""
    return torch.cat((torch.arange(0, dim, 2), torch.arange(1, dim, 2)))


def row_orders(m: MlaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows to read, in order, of the query projection [H (dn + dr)] and of
    kv_a_proj_with_mqa [r + R dr]: identity, or each rotated block in halves order."""
    q = torch.arange(m.heads * m.qk_dim).view(m.heads, m.qk_dim)
    kv = torch.arange(m.row_width)
    if not m.interleaved:
        return q.reshape(-1), kv
    rope = halves(m.rope_dim)
    q = torch.cat((q[:, : m.nope_dim], q[:, m.nope_dim:].index_select(1, rope)), dim=1).reshape(-1)
    keys = kv[m.kv_rank:].view(m.rope_heads, m.rope_dim).index_select(1, rope).reshape(-1)
    return q, torch.cat((kv[: m.kv_rank], keys))


def latent_layer(p: str, config, get, proj, norm, rows, mlp: dict, has) -> LayerWeights:
    m: MlaConfig = config.mla
    attn = p + "self_attn."
    q_order, kv_order = row_orders(m)
    if m.q_rank:
        first, first_bias = proj(attn + "q_a_proj.weight"), attn + "q_a_proj.bias"
        q_b = rows(attn + "q_b_proj.weight", q_order)
    else:
        first, first_bias = rows(attn + "q_proj.weight", q_order), attn + "q_proj.bias"
        q_b = None
    kv_a = rows(attn + "kv_a_proj_with_mqa.weight", kv_order)
    parts = [first, kv_a]
    in_proj = torch.cat(parts) if all(isinstance(t, torch.Tensor) for t in parts) else RowStack(parts)
    in_bias = None
    kv_bias = attn + "kv_a_proj_with_mqa.bias"
    if has(first_bias) or has(kv_bias):  # a converted model's (mha2mla.py): zeros where one is absent
        like = get(first_bias if has(first_bias) else kv_bias)
        q_rows = m.q_rank or m.heads * m.qk_dim
        qb = like.new_zeros(q_rows) if not has(first_bias) else like if m.q_rank else like[q_order.to(like.device)]
        kb = get(kv_bias)[kv_order.to(like.device)] if has(kv_bias) else like.new_zeros(m.row_width)
        in_bias = torch.cat((qb, kb))
    latent = LatentWeights(
        in_proj=in_proj, in_bias=in_bias,
        q_a_norm=norm(attn + "q_a_layernorm.weight") if m.q_rank else None, q_b=q_b,
        kv_a_norm=norm(attn + "kv_a_layernorm.weight") if m.latent_norm else None,
        kv_b=get(attn + "kv_b_proj.weight"),
        o_bias=get(attn + "o_proj.bias") if has(attn + "o_proj.bias") else None)
    return LayerWeights(
        input_norm=norm(p + "input_layernorm.weight"), qkv=None, qkv_bias=None, o=proj(attn + "o_proj.weight"),
        q_norm=None, k_norm=None, post_norm=norm(p + "post_attention_layernorm.weight"), latent=latent, **mlp)
