"""SparseSpec-L's selection (drafters/sparsespec.py): which keys each layer and K/V head keeps.

Two ways to the same scores, the attention weight each key got from the last verified rows,
summed over the rows and over the query heads that share the K/V head:

- fast: the native layer's scores option (kernels/decoder_layer.py, attention.c
  outrider_attention_mass) adds up, during the verify forward itself, the softmax weights its
  attention computed anyway: ForwardOutput.attention [B, layers, G, kv_len]. Nothing is
  recomputed; `keep` picks the kept positions of every layer and head at once.
- slow, the reference (a target the native layer does not run, and the tests): the rows' hidden
  states entering each layer, tapped in the verify forward, give their queries again (`queries`:
  norm, q projection, q norm, rotary), scored against the layer's keys in torch (`query_mass`).

Both keep, per layer and K/V head, the SINK first positions, the RECENT last ones and the best of
the rest by those scores, BUDGET in all.
"""

from __future__ import annotations

import math

import torch

from ..models.layers import apply_rotary, linear, rms_norm, rotary_tables


def keep(mass: torch.Tensor, budget: int, sink: int, recent: int) -> torch.Tensor:
    """mass [..., L] (a score per key) -> kept positions [..., k] sorted, k = min(budget, L): the
    sink, the recent and the best of the rest by mass."""
    L = mass.shape[-1]
    if L <= budget:
        return torch.arange(L).expand(*mass.shape[:-1], L)
    mass = mass.clone()
    mass[..., :sink] = math.inf
    mass[..., L - recent:] = math.inf
    return mass.topk(budget, dim=-1).indices.sort(dim=-1).values


def query_mass(queries: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor | None = None) -> torch.Tensor:
    """queries [H, n, D] (rotated), keys [G, L, D], visible [n, L] bool (None: every key) -> [G, L]:
    per query the softmax of its scaled scores over the keys it sees, summed over the n rows and
    the H / G query heads of each K/V head (the native scores option's quantity, in torch)."""
    G, L, D = keys.shape
    H, n, _ = queries.shape
    scores = queries.reshape(G, (H // G) * n, D).float() @ keys.float().transpose(1, 2) / math.sqrt(D)  # [G, H/G n, L]
    if visible is not None:
        scores = scores.masked_fill(~visible.repeat(H // G, 1).unsqueeze(0), -math.inf)
    return torch.softmax(scores, dim=-1).sum(1)  # [G, L]


def queries(target, index: int, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Layer `index`'s rotated queries [H, n, D] of the rows whose hidden states entering it are
    hidden [n, E], at positions [n] (long)."""
    c, w = target.config, target.layers[index]
    H, D, n = c.num_heads, c.head_dim, hidden.shape[0]
    cos, sin = rotary_tables(positions.view(1, n).to(target.device), target.inv_freq, target.dtype, target.rope_scale)
    h = rms_norm(hidden.unsqueeze(0).to(target.dtype), w.input_norm, c.rms_norm_eps)  # [1, n, E]
    q = linear(h, w.qkv, w.qkv_bias)[..., : H * D]  # [1, n, H D]
    if w.q_norm is not None and c.qk_norm_whole:  # OLMoE: one norm over all the heads' queries
        q = rms_norm(q, w.q_norm, c.rms_norm_eps)
    q = q.view(1, n, H, D).transpose(1, 2)  # [1, H, n, D]
    if w.q_norm is not None and not c.qk_norm_whole:
        q = rms_norm(q, w.q_norm, c.rms_norm_eps)
    return apply_rotary(q, cos, sin)[0]


def select(queries_: torch.Tensor, keys: torch.Tensor, sparsity) -> torch.Tensor:
    """queries [H, n, D] (rotated), keys [G, L, D] -> kept positions [G, k] (sorted, k = min(BUDGET, L)):
    per K/V head, the sink, the recent and the best of the rest by softmax mass summed over the
    n rows and the H / G query heads of the group (every row sees every key: the slow path's)."""
    if keys.shape[1] <= sparsity.budget:
        return torch.arange(keys.shape[1]).expand(keys.shape[0], keys.shape[1])
    return keep(query_mass(queries_, keys), sparsity.budget, sparsity.sink, sparsity.recent)


@torch.inference_mode()
def select_torch(target, source, slot: int, rows: torch.Tensor, length: int, sparsity) -> torch.Tensor:
    """The slow path: kept positions [layers, G, k] of rows 0..length-1 of `slot` in the target's
    cache `source`, scored by the n rows whose taps (the hidden state entering every layer) are
    rows [n, layers, E], at positions length - n .. length - 1."""
    n = rows.shape[0]
    positions = torch.arange(length - n, length)
    out = []
    for index in range(len(target.layers)):
        q = queries(target, index, rows[:, index], positions)
        out.append(select(q, source.keys(index, slot, length), sparsity).cpu())
    return torch.stack(out)
