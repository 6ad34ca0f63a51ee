"""Sliding-window attention masks: a layer whose window is W lets a query at position p see a key
at position k only when k > p - W (transformers' `sliding_window_overlay`, llama.cpp's standard
SWA: p - k < W), on top of the causal or tree rule of the batch (models/batch.py).

    mask = window_mask(batch, W)          # [B, 1, T, kv_len] bool
    views = sliding_views(batch, config, dtype, view)   # window -> SpanView, one per distinct window

Positions, not cache rows, decide: a tree's node at row cache_len + i holds position cache_len +
depth(i) (batch.key_pos; row r holds position r where key_pos is None), so a draft whose root-to-
node path crosses the window's edge loses the same keys a one-token-a-step decode of that path
loses. Here every row stays in the cache, masked: the reference (config sliding_ring=off) for the
rings that keep only the rows a window still reads (ring_cache.py, ring_attention.py).
"""

from __future__ import annotations

import torch

from .attention_layer import SpanView
from .layers import fold_mask


def in_window(keys: torch.Tensor, queries: torch.Tensor, window: int) -> torch.Tensor:
    """The window's rule, broadcast: a key at position k is seen from a query at p when k > p - W
    (here and in the rings' masks, ring_attention.py)."""
    return keys > queries - window


def window_mask(batch, window: int) -> torch.Tensor:
    """[B, 1, T, kv_len] bool: batch's own mask (causal when it has none) and'ed with the window."""
    B, T = batch.tokens.shape
    L = batch.kv_len
    device = batch.tokens.device
    mask = batch.attn_mask
    if mask is None:  # one slot, its T new tokens the last T of L rows, causal among themselves
        mask = torch.ones(T, L, dtype=torch.bool, device=device).tril(L - T).view(1, 1, T, L)
    keys = batch.key_pos if batch.key_pos is not None else torch.arange(L, device=device).view(1, L)  # [B or 1, L]
    queries = batch.positions.view(B, 1, T, 1)
    mask = mask & in_window(keys.view(keys.shape[0], 1, 1, L), queries, window)  # [B, 1, T, L]
    mask[..., 0] |= ~mask.any(-1)  # padded rows see row 0 (as batch.py leaves them); a real row sees itself
    return mask


def sliding_views(batch, config, dtype: torch.dtype, view: SpanView, span_mask) -> dict[int, SpanView]:
    """One SpanView per distinct window of `config`'s layers, for `batch` (made once a forward, like
    the full layers' `view`); span_mask: decoder._span_mask, for slots with holes."""
    groups = config.num_heads // config.num_kv_heads
    views = {}
    for window in sorted({w for w in config.layer_windows if w}):
        mask = window_mask(batch, window)
        if view.place is not None:
            mask = span_mask(mask, view.place, view.span)
        views[window] = SpanView(mask, fold_mask(mask, groups, dtype), view.place, view.first, view.span)
    return views
