"""Per-slot preallocated K/V cache.

Layout per layer: `k[layer]`, `v[layer]`: [num_slots, kv_heads, max_len + 1, head_dim]. Row r of a
slot holds the K/V of the token at cache position r (for a tree, node i of this round is written
to row `length + i` and reads its rotary position from the batch, not from its row). The extra
last row is a scratch row that padded tokens of a ragged batch write into.

Lengths live on the host (`lengths[slot]`): the engine always knows them, so building a batch
never reads the device. Rolling back rejected drafts is setting a length. Committing a tree path
that is not contiguous copies those rows down (`compact`).
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        max_len: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        shape = (num_slots, kv_heads, max_len + 1, head_dim)
        # zeros, not empty: masked rows are multiplied by a zero weight, and 0 * NaN is NaN.
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_len = max_len
        self.scratch_row = max_len
        self.lengths = [0] * num_slots

    @property
    def num_slots(self) -> int:
        return len(self.lengths)

    def free_rows(self, slot: int) -> int:
        return self.max_len - self.lengths[slot]

    def set_length(self, slot: int, length: int) -> None:
        """Advance after a commit or roll back rejected rows: only the length moves."""
        if not 0 <= length <= self.max_len:
            raise ValueError(f"slot {slot}: length {length} outside [0, {self.max_len}]")
        self.lengths[slot] = length

    def compact(self, slot: int, src_rows: list[int], dst_start: int) -> None:
        """Copy rows `src_rows` (increasing) to `dst_start, dst_start + 1, ...`.

        Example: length 10, tree nodes 0..5 written at rows 10..15, accepted path [0, 2, 5]:
        compact(slot, [10, 12, 15], 10) moves rows 12 -> 11 and 15 -> 12. Rows already in
        place are skipped, so a chain (always contiguous) costs nothing.
        """
        moves = [(s, dst_start + i) for i, s in enumerate(src_rows) if s != dst_start + i]
        if not moves or not self.k:  # in place, or no attention layers (a gated-delta drafter's)
            return
        src = torch.tensor([s for s, _ in moves], device=self.k[0].device)
        dst = torch.tensor([d for _, d in moves], device=self.k[0].device)
        for cache in (*self.k, *self.v):
            rows = cache[slot].index_select(1, src)  # [kv_heads, m, head_dim]
            cache[slot].index_copy_(1, dst, rows)

    def copy_rows(self, src_slot: int, dst_slot: int, n: int) -> None:
        """Rows 0..n-1 of slot `src_slot` into slot `dst_slot` (a shared prompt's K/V)."""
        for cache in (*self.k, *self.v):
            cache[dst_slot, :, :n] = cache[src_slot, :, :n]

    def can_copy_prefix(self, src_slot: int, n: int) -> bool:
        """Any prefix of K/V rows can be copied."""
        return True

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    # -- what an attention layer writes and reads ------------------------------------------------
    def write(self, layer: int, slots: torch.Tensor, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [B, T, G, D] to rows[b, t] (long [B, T]) of slots[b] (long [B]); a float16 cache
        rounds them to nearest."""
        # advanced indices split by a slice: the indexed view is [B, T, G, D]
        self.k[layer][slots.unsqueeze(1), :, rows] = k.to(self.k[layer].dtype)
        self.v[layer][slots.unsqueeze(1), :, rows] = v.to(self.v[layer].dtype)

    def write_slot(self, layer: int, slot: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [G, m, D] to rows start .. start + m - 1 of one slot."""
        self.k[layer][slot, :, start: start + k.shape[1]] = k
        self.v[layer][slot, :, start: start + v.shape[1]] = v

    def span(self, layer: int, first: int, size: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of slots first .. first + size - 1, rows 0 .. length - 1: [S, G, L, D] views."""
        return (self.k[layer][first: first + size, :, :length], self.v[layer][first: first + size, :, :length])

    def gather(self, layer: int, slots: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of `slots` (long [S]), rows 0 .. length - 1: [S, G, L, D] copies."""
        return self.k[layer][slots, :, :length], self.v[layer][slots, :, :length]

    def keys(self, layer: int, slot: int, length: int) -> torch.Tensor:
        """A slot's first `length` keys of a layer, [kv_heads, length, head_dim] (a view: read only)."""
        return self.k[layer][slot, :, :length]

    def gather_from(self, source: "KVCache", src_slot: int, dst_slot: int, kept: torch.Tensor) -> None:
        """Rows kept[l, g] (long [layers, G, k]: per layer and K/V head, positions of `source`'s
        slot) into rows 0..k-1 of this cache's slot, per head: one index_select of K and of V a
        layer (a head's row r is row g * rows + r of the slot viewed flat)."""
        layers, G, k = kept.shape
        rows, D = source.k[0].shape[2:]  # a head's rows in the source, its size
        flat = (kept + torch.arange(G).view(1, G, 1) * rows).reshape(layers, G * k)  # [layers, G k]
        for index in range(layers):
            at = flat[index].to(self.k[index].device)  # [G k]
            for own, src in ((self.k[index], source.k[index]), (self.v[index], source.v[index])):
                picked = src[src_slot].reshape(G * rows, D).index_select(0, at)  # [G k, D]
                own[dst_slot, :, :k] = picked.view(G, k, D)

    def grow_slots(self, num_slots: int) -> None:
        """Hold `num_slots` slots (more than now), keeping every slot's rows and length."""
        if num_slots <= self.num_slots:
            return
        for caches in (self.k, self.v):
            for i, old in enumerate(caches):
                grown = torch.zeros((num_slots, *old.shape[1:]), dtype=old.dtype, device=old.device)
                grown[: old.shape[0]] = old
                caches[i] = grown
        self.lengths += [0] * (num_slots - len(self.lengths))

    def ensure_capacity(self, slot_rows: int) -> None:
        """Grow every slot to hold at least `slot_rows` rows (doubling), keeping what is stored."""
        if slot_rows <= self.max_len:
            return
        new_len = max(slot_rows, 2 * self.max_len)
        for caches in (self.k, self.v):
            for i, old in enumerate(caches):
                shape = (old.shape[0], old.shape[1], new_len + 1, old.shape[3])
                grown = torch.zeros(shape, dtype=old.dtype, device=old.device)
                grown[:, :, : self.max_len] = old[:, :, : self.max_len]
                caches[i] = grown
        self.max_len = new_len
        self.scratch_row = new_len
