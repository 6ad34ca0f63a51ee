"""Multi-head latent attention (MLA: DeepSeek-V2, MiniCPM3) over a batch of slots, in torch ops.

Each token keeps, per layer, one row of r + dr values (latent_cache.py): the latent c_kv
(kv_a_proj_with_mqa's first r outputs, RMS-normed) and its rotated key (the last dr, rotated as a
single head, shared by every query head). A head's key and value are expanded from the latent by
kv_b_proj: k_nope_h = W_UK_h c, v_h = W_UV_h c (W_UK_h [dn, r], W_UV_h [dv, r]); its query is
q_nope_h (dn) and q_pe_h (dr, rotated):

    score_h(t, s) = scale * (q_nope_h(t) . W_UK_h c(s) + q_pe_h(t) . k_pe(s))
    out_h(t)      = sum_s softmax_s(score_h(t, .)) W_UV_h c(s)         then o_proj over the heads

Two forms compute it from the same rows:

- plain (`_plain`): every cached row expanded into per-head keys and values, then attention as
  transformers computes it. Its cost grows with the context times H (dn + dv) r: a prefill's.
- absorbed (`_absorbed`): W_UK absorbed into the query (q_lat_h = W_UK_h^T q_nope_h, [r]) and W_UV
  into the output (out_h = W_UV_h o_lat_h), so the scores read the cached rows as they are, one
  key of width r + dr shared by every head (multi-query attention: score = q_lat . c + q_pe . k_pe)
  with the latent as the value. Nothing is expanded: what decode and verify want.

`absorbed_form(T, mla)` chooses by the rows a slot brings (tests/test_mla.py holds the forms to
each other on the same batches). A converted model (mla.rope_heads > 1) keeps one rotated key per
source K/V head: head h reads key h // (H / rope_heads); in the absorbed form its q_pe sits in its
key's columns of a zero-padded query, so one shared row still serves every head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .layers import apply_rotary, attention, linear, rms_norm
from .mla_config import LATENT_NORM_EPS, MlaConfig


@dataclass
class LatentWeights:
    """One latent-attention layer's weights (LayerWeights.o is its o_proj)."""

    in_proj: object  # [Q + r + R dr, E]: q_proj's rows (Q = H (dn + dr)) or q_a_proj's (Q = q_rank), then
    #                  kv_a_proj_with_mqa's (latent, then each rotated key); RoPE rows in halves order
    in_bias: torch.Tensor | None  # [Q + r + R dr] or None
    q_a_norm: torch.Tensor | None  # [q_rank]: q_a_layernorm (None: no q LoRA)
    q_b: object | None  # [H (dn + dr), q_rank]
    kv_a_norm: torch.Tensor | None  # [r]: kv_a_layernorm (None: a converted model's latent, unnormed)
    kv_b: torch.Tensor  # [H (dn + dv), r] float: kv_b_proj
    o_bias: torch.Tensor | None = None  # [E]

    def w_uk(self, m: MlaConfig) -> torch.Tensor:
        """[H, dn, r]: each head's keys from the latent (a view of kv_b)."""
        return self.kv_b.view(m.heads, m.nope_dim + m.v_dim, m.kv_rank)[:, : m.nope_dim]

    def w_uv(self, m: MlaConfig) -> torch.Tensor:
        """[H, dv, r]: each head's values from the latent (a view of kv_b)."""
        return self.kv_b.view(m.heads, m.nope_dim + m.v_dim, m.kv_rank)[:, m.nope_dim:]

    @property
    def matrices(self) -> list:
        return [p for p in (self.in_proj, self.q_b, self.kv_b) if p is not None]


def absorbed_form(rows: int, m: MlaConfig) -> bool:
    """Whether a forward bringing `rows` new rows a slot runs absorbed. Per cached row, the plain
    form expands H (dn + dv) r products; the absorbed form reads rows r - dn wider for its scores
    and r - dv for its output, per head and new row: absorbed while rows (2r - dn - dv) <= (dn + dv) r."""
    extra = 2 * m.kv_rank - m.nope_dim - m.v_dim
    return extra <= 0 or rows * extra <= (m.nope_dim + m.v_dim) * m.kv_rank


def project(w: LatentWeights, m: MlaConfig, h: torch.Tensor, cos, sin) -> tuple:
    """h [B, T, E] (normed) -> q_nope [B, H, T, dn], q_pe [B, H, T, dr] (rotated), and the rows to
    cache [B, T, r + R dr]: the latent (normed) then each rotated key."""
    B, T, _ = h.shape
    H, R, dr = m.heads, m.rope_heads, m.rope_dim
    a = linear(h, w.in_proj, w.in_bias)  # [B, T, Q + r + R dr]
    kv = a[..., a.shape[-1] - m.row_width:]  # [B, T, r + R dr]
    q = a[..., : a.shape[-1] - m.row_width]
    if w.q_b is not None:
        q = linear(rms_norm(q, w.q_a_norm, LATENT_NORM_EPS), w.q_b)  # [B, T, H (dn + dr)]
    q = q.reshape(B, T, H, m.qk_dim).transpose(1, 2)  # [B, H, T, dn + dr]
    q_pe = apply_rotary(q[..., m.nope_dim:], cos, sin)  # [B, H, T, dr]
    latent = kv[..., : m.kv_rank]
    if w.kv_a_norm is not None:
        latent = rms_norm(latent, w.kv_a_norm, LATENT_NORM_EPS)
    k_pe = apply_rotary(kv[..., m.kv_rank:].reshape(B, T, R, dr).transpose(1, 2), cos, sin)  # [B, R, T, dr]
    rows = torch.cat((latent, k_pe.transpose(1, 2).reshape(B, T, R * dr)), dim=-1)  # [B, T, r + R dr]
    return q[..., : m.nope_dim], q_pe, rows


def latent_mixer(w, c, h: torch.Tensor, batch, cache, index: int, cos, sin, view) -> torch.Tensor:
    """h [B, T, E] (normed) -> the attention's output projected back, [B, T, E]; writes the
    batch's rows into layer `index` of `cache` (a LatentCache)."""
    m: MlaConfig = c.mla
    lw: LatentWeights = w.latent
    B, T, _ = h.shape
    q_nope, q_pe, rows = project(lw, m, h, cos, sin)
    cache.write(index, batch.slots, batch.rows, rows)
    cached = cache.span(index, view.first, view.span, batch.kv_len)  # [S, 1, L, r + R dr], a view
    if cached.dtype != h.dtype:  # a float16 cache: its values widened exactly
        cached = cached.to(h.dtype)
    run = _absorbed if absorbed_form(T, m) else _plain
    if view.place is not None:  # slots with holes or out of order: queries go to their span rows
        pad = lambda x: x.new_zeros(view.span, *x.shape[1:]).index_copy_(0, view.place, x)  # noqa: E731
        out = run(lw, m, pad(q_nope), pad(q_pe), cached, view).index_select(0, view.place)
    else:
        out = run(lw, m, q_nope, q_pe, cached, view)  # [B, H, T, dv]
    return linear(out.transpose(1, 2).reshape(B, T, m.heads * m.v_dim), w.o, lw.o_bias)


def _plain(w: LatentWeights, m: MlaConfig, q_nope, q_pe, cached, view) -> torch.Tensor:
    """q_nope [S, H, T, dn], q_pe [S, H, T, dr], cached [S, 1, L, r + R dr] -> [S, H, T, dv]: every
    cached row expanded to per-head keys and values (transformers' arithmetic)."""
    S, H, T, _ = q_nope.shape
    L = cached.shape[2]
    kv = linear(cached[:, 0, :, : m.kv_rank], w.kv_b)  # [S, L, H (dn + dv)]
    kv = kv.view(S, L, H, m.nope_dim + m.v_dim).transpose(1, 2)  # [S, H, L, dn + dv]
    k_pe = cached[:, 0, :, m.kv_rank:].reshape(S, L, m.rope_heads, m.rope_dim).transpose(1, 2)  # [S, R, L, dr]
    k_pe = k_pe.repeat_interleave(H // m.rope_heads, dim=1)  # [S, H, L, dr]
    keys = torch.cat((kv[..., : m.nope_dim], k_pe), dim=-1)  # [S, H, L, dn + dr]
    query = torch.cat((q_nope, q_pe), dim=-1)  # [S, H, T, dn + dr]
    return attention(query, keys, kv[..., m.nope_dim:], view.mask, None, m.scale)  # [S, H, T, dv]


def _absorbed(w: LatentWeights, m: MlaConfig, q_nope, q_pe, cached, view) -> torch.Tensor:
    """The same from the cached rows as they are: q_lat = W_UK^T q_nope, one shared key of width
    r + R dr and the latent as the value, then W_UV on each head's output."""
    S, H, T, _ = q_nope.shape
    q_lat = torch.einsum("shtn,hnr->shtr", q_nope, w.w_uk(m))  # [S, H, T, r]
    if m.rope_heads > 1:  # head h's q_pe in its rotated key's columns, zeros in the others'
        R = m.rope_heads
        own = torch.eye(R, dtype=q_pe.dtype, device=q_pe.device).view(1, R, 1, 1, R, 1)
        q_pe = (q_pe.reshape(S, R, H // R, T, 1, m.rope_dim) * own).reshape(S, H, T, R * m.rope_dim)
    query = torch.cat((q_lat, q_pe), dim=-1)  # [S, H, T, r + R dr]
    o_lat = attention(query, cached, cached[..., : m.kv_rank], view.mask, view.folded, m.scale)  # [S, H, T, r]
    return torch.einsum("shtr,hvr->shtv", o_lat, w.w_uv(m))  # [S, H, T, dv]
