"""The K/V rows of sliding-window layers kept in a ring: a slot holds only the rows its window can
still read, so a sliding layer's memory is bounded by its window, not by the context.

One `RingKV` holds the sliding layers of one window W. Per layer `k[layer]`, `v[layer]`:
[num_slots, kv_heads, C + 1, head_dim], C = W - 1 + R ring rows and a scratch row (padding's).
Cache row r (the row a KVCache would use: the batch's rows, models/batch.py) lives at ring row
r mod C. R is the most rows past a slot's length one forward may write (a verify tree, a draft
model's tree grown depth by depth, a prefill chunk: models/ring_attention.py cuts a longer prompt
into R-row chunks inside the layer, and grows the ring for a wider tree).

Why C = W - 1 + R is enough, and exact under speculation: a forward over a slot of length L reads
committed rows >= L - W + 1 only (its queries sit at positions >= L) and writes rows L .. L + R - 1
at most. Any C consecutive cache rows fall on distinct ring rows, and rows L - W + 1 .. L + R - 1
are C of them: no row written lands on a committed row the window still reads. So a rejected
draft's rows never overwrite a row inside a committed token's window, and a tree's accepted rows,
moved into place by `compact`, move among the forward's own rows.

What a slot holds, on the host (never read from the device): `end[slot]`, one past the highest
row written since the slot was emptied, and `low[slot]`, the first row a prefix copy brought.
Rows held intact: max(low, end - C) .. length - 1 (`held_from`). Cutting a slot back below what
its window would then need (set_length to n with n - W + 1 < held_from) raises, as a recurrent
state does (models/delta_state.py); so does copying a prefix whose window is no longer held.
These checks are what keeps a cut prompt exact too: a later chunk writes over an earlier chunk's
rows, and a length whose window they held is refused, never read wrong.
"""

from __future__ import annotations

import torch

from ..errors import ModelError

ROWS = 256  # R by default: a verify tree or a prefill chunk's rows a forward without growing


class RingKV:
    def __init__(self, num_layers: int, num_slots: int, window: int, rows: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, scratch_row: int):
        if window < 1 or rows < 1:
            raise ValueError(f"a ring needs window >= 1 and rows >= 1, got {window}, {rows}")
        self.window, self.rows = window, rows
        shape = (num_slots, kv_heads, self.capacity + 1, head_dim)
        # zeros, not empty: masked rows are multiplied by a zero weight, and 0 * NaN is NaN.
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.scratch_row = scratch_row  # the cache row padding writes to (the state's): ring row C
        self.end = [0] * num_slots
        self.low = [0] * num_slots

    @property
    def capacity(self) -> int:
        """C: ring rows a slot holds (the scratch row aside)."""
        return self.window - 1 + self.rows

    def held_from(self, slot: int) -> int:
        """The first cache row this slot's ring still holds as it was written."""
        return max(self.low[slot], self.end[slot] - self.capacity, 0)

    def ring_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Cache rows (long, any shape) -> ring rows: r mod C; padding (a negative row or the
        state's scratch row) -> C."""
        pad = (rows < 0) | (rows >= self.scratch_row)
        return torch.where(pad, self.capacity, rows.remainder(self.capacity))

    # -- a forward: made room for, noted, written, read --------------------------------------------
    def fit(self, rows: int) -> None:
        """Let one forward write `rows` rows past a slot's length: grow R to it when it is more,
        every slot's held rows moved to their rows mod the new C (a tree wider than R; rare)."""
        if rows <= self.rows:
            return
        old_c = self.capacity
        self.rows = rows
        new_c = self.capacity
        with torch.inference_mode(False):  # called in a forward: the grown rings stay plain tensors
            self._relayout(old_c, new_c)

    def _relayout(self, old_c: int, new_c: int) -> None:
        for caches in (self.k, self.v):
            for i, old in enumerate(caches):
                grown = torch.zeros((old.shape[0], old.shape[1], new_c + 1, old.shape[3]), dtype=old.dtype,
                                    device=old.device)
                for slot in range(old.shape[0]):
                    held = torch.arange(max(self.low[slot], self.end[slot] - old_c, 0), self.end[slot])
                    src, dst = (held % old_c).to(old.device), (held % new_c).to(old.device)
                    grown[slot].index_copy_(1, dst, old[slot].index_select(1, src))
                caches[i] = grown

    def note(self, slots: list[int], ends: list[int]) -> None:
        """A forward writes rows up to ends[b] - 1 of slots[b] (host ints, before its writes)."""
        for slot, end in zip(slots, ends):
            self.end[slot] = max(self.end[slot], end)

    def write(self, layer: int, slots: torch.Tensor, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [B, T, G, D] to cache rows rows[b, t] (long [B, T]) of slots[b] (long [B]), at their ring rows."""
        at = self.ring_rows(rows)  # [B, T]
        self.k[layer][slots.unsqueeze(1), :, at] = k.to(self.k[layer].dtype)
        self.v[layer][slots.unsqueeze(1), :, at] = v.to(self.v[layer].dtype)

    def span(self, layer: int, first: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every ring row of slots first .. first + size - 1: [S, G, C, D] views (ring_attention.py's
        mask says which cache row each holds, and which it may read)."""
        C = self.capacity
        return self.k[layer][first: first + size, :, :C], self.v[layer][first: first + size, :, :C]

    # -- the slot interface's side (models/sliding_state.py) -----------------------------------------
    def keep(self, slot: int, n: int) -> None:
        """set_length's check: a length of n reads rows n - W + 1 .. n - 1 next; refused when the
        ring no longer holds them. n == 0 empties the slot."""
        if n == 0:
            self.end[slot] = self.low[slot] = 0
        elif max(n - self.window + 1, 0) < self.held_from(slot):
            raise ModelError(f"slot {slot}: a sliding window of {self.window} keeps rows from "
                             f"{self.held_from(slot)} on and cannot be cut back to {n} positions")

    def compact(self, slot: int, src_rows: list[int], dst_start: int) -> None:
        """Cache rows `src_rows` (increasing, this round's) to dst_start, dst_start + 1, ..."""
        moves = [(s, dst_start + i) for i, s in enumerate(src_rows) if s != dst_start + i]
        if not moves or not self.k:
            return
        if moves[0][0] < self.held_from(slot):
            raise ModelError(f"slot {slot}: row {moves[0][0]} has left the sliding window's ring")
        if max(dst_start - self.window + 1, 0) < self.held_from(slot):  # rows moved down past the window
            raise ModelError(f"slot {slot}: a sliding window's ring cannot move rows down to {dst_start} "
                             "(config sliding_ring=off keeps every row)")
        C = self.capacity
        src = torch.tensor([s % C for s, _ in moves], device=self.k[0].device)
        dst = torch.tensor([d % C for _, d in moves], device=self.k[0].device)
        for cache in (*self.k, *self.v):
            rows = cache[slot].index_select(1, src)  # [G, m, D]: read all before writing any
            cache[slot].index_copy_(1, dst, rows)

    def can_copy_prefix(self, src: int, n: int) -> bool:
        """Whether the ring of `src` still holds the rows a length of n reads next."""
        return max(n - self.window + 1, 0) >= self.held_from(src) and n <= self.end[src]

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """The first n positions of slot src into slot dst: the W - 1 rows before n are what they read."""
        if not self.can_copy_prefix(src, n):
            raise ModelError(f"slot {src}: a sliding window of {self.window} no longer holds rows "
                             f"{max(n - self.window + 1, 0)} .. {n - 1}")
        rows = (torch.arange(max(n - self.window + 1, 0), n) % self.capacity).to(self.k[0].device if self.k else "cpu")
        for cache in (*self.k, *self.v):
            cache[dst, :, rows] = cache[src, :, rows]
        self.low[dst], self.end[dst] = max(n - self.window + 1, 0), n

    def grow_slots(self, num_slots: int) -> None:
        for caches in (self.k, self.v):
            for i, old in enumerate(caches):
                if num_slots > old.shape[0]:
                    grown = torch.zeros((num_slots, *old.shape[1:]), dtype=old.dtype, device=old.device)
                    grown[: old.shape[0]] = old
                    caches[i] = grown
        extra = num_slots - len(self.end)
        if extra > 0:
            self.end += [0] * extra
            self.low += [0] * extra

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))
