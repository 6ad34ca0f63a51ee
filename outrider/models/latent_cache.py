"""The slot state of a latent-attention model (latent_layer.py): per layer and token, one row of
r + R dr values (the latent c_kv, then each rotated key), not per-head keys and values.

Layout per layer: `k[layer]`: [num_slots, 1, max_len + 1, r + R dr] (one shared "head": the
absorbed form reads it as multi-query attention's key, its first r columns as the value); `v` is
empty. Rows are written by position and cut back by a length, as in a KVCache, whose calls it
keeps (set_length, compact, copy_rows, grow_slots, ensure_capacity, nbytes: models/state.py).

Bytes a token holds: layers x (r + R dr) x the element size. DeepSeek-V2 (r 512, dr 64, 60 layers)
keeps 576 values a layer where its 128 heads would keep 128 x (192 + 128) = 40,960 as K/V.
"""

from __future__ import annotations

import torch

from .kv_cache import KVCache


class LatentCache(KVCache):
    def __init__(self, num_layers: int, num_slots: int, max_len: int, width: int, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__(0, num_slots, max_len, 1, width, dtype, device)
        # zeros, not empty: masked rows are multiplied by a zero weight, and 0 * NaN is NaN.
        self.k = [torch.zeros((num_slots, 1, max_len + 1, width), dtype=dtype, device=device)
                  for _ in range(num_layers)]
        self.v = []  # the values are the latent: the rows' first r columns

    @property
    def width(self) -> int:
        return self.k[0].shape[-1] if self.k else 0

    def bytes_per_token(self) -> int:
        """What one token holds over every layer (state nbytes per position)."""
        return sum(t.shape[-1] * t.element_size() for t in self.k)

    def write(self, layer: int, slots: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
        """values [B, T, width] to rows[b, t] (long [B, T]) of slots[b] (long [B])."""
        self.k[layer][slots.unsqueeze(1), :, rows] = values.unsqueeze(2).to(self.k[layer].dtype)

    def span(self, layer: int, first: int, size: int, length: int) -> torch.Tensor:
        """Rows 0 .. length - 1 of slots first .. first + size - 1: [S, 1, L, width], a view."""
        return self.k[layer][first: first + size, :, :length]

    def keys(self, layer: int, slot: int, length: int) -> torch.Tensor:
        raise TypeError("a latent-attention cache keeps latents, not per-head keys")

    gather = gather_from = write_slot = keys
