"""Mask-based rewind: a stage's K/V rows never move; rejected rows stay and are masked out.

The engine speaks of a slot's state by position (models/state.py): a forward writes the new
tokens at rows `length + i`, a rejected round keeps the length (`set_length`), an accepted tree
path is copied down to the committed prefix (`compact`). That is the physical trim, what a
`KVCache` does (the reference). Pipeline-sharded inference (seed #8) keeps the cache append-only
instead: each forward's rows go to fresh physical rows past every row the slot used, and a
slot's positions are a map `rows[slot][p]` = the physical row holding position p. Rewinding cuts
the map, committing a tree path rewrites it; nothing is copied, and the forward's attention
mask shows each query only the physical rows its positions map to (the rotary positions come
from the batch, so a key's values do not depend on the row it sits in).

Example: length 5 (rows 0..4), a verify of 3 nodes at physical rows 5, 6, 7 of which the path
[0, 2] is accepted: positions 5, 6 map to rows 5, 7 and row 6 stays, masked. The next forward
writes at rows 8.. and its queries see rows 0..5 and 7.

When a slot's physical rows run out, its mapped rows are moved down once (`_repack`: the same
values, in position order) and the slot goes on from there. While no slot of a batch has a gap
(a prompt; rounds with nothing rejected) its rows are its positions and the batch keeps its own
mask, so a long prompt is filled in the parts one process fills it in (models/decoder.py); only
padding moves, to the physical scratch row.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..models.batch import ForwardBatch
from ..models.kv_cache import KVCache


class MaskedRows:
    """A stage's K/V for its layers (`kv`, rows by physical position) with the engine's state calls
    (positions), rewinding by masking. `physical` rows a slot: at least twice the positions."""

    def __init__(self, kv: KVCache, max_len: int):
        self.kv = kv  # kv.lengths[slot]: physical rows used (the next forward appends there)
        self.max_len = max_len  # positions a slot may hold
        self.rows: list[list[int]] = [[] for _ in range(kv.num_slots)]  # slot -> physical row of each position
        self.lengths = [0] * kv.num_slots  # positions committed

    @property
    def num_slots(self) -> int:
        return len(self.lengths)

    @property
    def scratch_row(self) -> int:
        return self.max_len  # the engine's padding row; mapped to the physical scratch row

    # -- the engine's state calls (positions) --------------------------------------------------------
    def set_length(self, slot: int, length: int) -> None:
        """Keep positions 0..length-1: rows past them are no longer mapped (masked, not cut)."""
        if not 0 <= length <= len(self.rows[slot]):
            raise ValueError(f"slot {slot}: length {length} past the {len(self.rows[slot])} positions written")
        del self.rows[slot][length:]
        self.lengths[slot] = length
        if length == 0:
            self.kv.set_length(slot, 0)  # an emptied slot starts again at row 0

    def compact(self, slot: int, src_rows: list[int], dst_start: int) -> None:
        """Positions src_rows (increasing) become positions dst_start, ...: the map only."""
        mapped = self.rows[slot]
        for i, src in enumerate(src_rows):
            mapped[dst_start + i] = mapped[src]

    def copy_rows(self, src_slot: int, dst_slot: int, n: int) -> None:
        """The first n positions of src_slot into dst_slot, packed at rows 0..n-1."""
        rows = torch.tensor(self.rows[src_slot][:n], dtype=torch.long)
        for cache in (*self.kv.k, *self.kv.v):
            cache[dst_slot, :, :n] = cache[src_slot].index_select(1, rows)
        self.rows[dst_slot] = list(range(n))
        self.lengths[dst_slot] = n
        self.kv.set_length(dst_slot, n)

    def grow_slots(self, num_slots: int) -> None:
        self.kv.grow_slots(num_slots)
        while len(self.rows) < num_slots:
            self.rows.append([])
            self.lengths.append(0)

    def ensure_capacity(self, slot_rows: int) -> None:
        """As KVCache's: at least `slot_rows` positions (doubling), twice as many physical rows."""
        if slot_rows <= self.max_len:
            return
        self.max_len = max(slot_rows, 2 * self.max_len)
        self.kv.ensure_capacity(2 * self.max_len)

    def nbytes(self) -> int:
        return self.kv.nbytes()

    # -- a forward: positions to physical rows -------------------------------------------------------
    def physical(self, batch: ForwardBatch) -> ForwardBatch:
        """`batch` (rows by position, the engine's) with its new rows at fresh physical rows and a
        mask over physical rows that shows each query what the positional mask showed it."""
        B, T = batch.tokens.shape
        logical = batch.rows.tolist()  # [B][T]: positions written (the scratch row for padding)
        fresh = []  # per batch row: {position: physical row}
        for b, slot in enumerate(batch.slot_ids):
            written = sorted({r for r in logical[b] if r != self.scratch_row and r >= 0})
            if written and written[0] != len(self.rows[slot]):
                del self.rows[slot][written[0]:]  # rows past the positions written before are rewritten
            need = written[-1] - written[0] + 1 if written else 0
            if self.kv.lengths[slot] + need > self.kv.max_len:
                self._repack(slot, need)
            base = self.kv.lengths[slot]
            fresh.append({r: base + r - written[0] for r in written})
            self.kv.lengths[slot] = base + need
        scratch = self.kv.scratch_row
        if all(self._packed(slot, fresh[b]) for b, slot in enumerate(batch.slot_ids)):
            # no gaps yet (a prompt, rounds with nothing rejected): rows are positions, the batch's own
            # mask holds (and a long prompt is filled in the parts one process fills it in)
            for b, slot in enumerate(batch.slot_ids):
                self.rows[slot] += sorted(fresh[b].values())
            return replace(batch, rows=torch.where(batch.rows == self.scratch_row, scratch, batch.rows))
        rows = torch.tensor([[fresh[b].get(r, scratch) for r in logical[b]] for b in range(B)], dtype=torch.long)
        kv_len = max(self.kv.lengths[s] for s in batch.slot_ids)
        L = batch.kv_len
        if batch.attn_mask is None:  # one slot, causal: position r visible to the query at position rows[t]
            seen = torch.arange(L).view(1, 1, 1, L) <= batch.rows.view(B, 1, T, 1)  # [1, 1, T, L]
        else:
            seen = batch.attn_mask  # [B, 1, T, L] by position
        columns = torch.full((B, L), kv_len, dtype=torch.long)  # unmapped positions: a column cut off below
        for b, slot in enumerate(batch.slot_ids):
            held = self.rows[slot] + [fresh[b][r] for r in sorted(fresh[b])]
            n = min(len(held), L)
            columns[b, :n] = torch.tensor(held[:n], dtype=torch.long)
        mask = torch.zeros((B, 1, T, kv_len + 1), dtype=torch.bool)
        mask.scatter_(3, columns.view(B, 1, 1, L).expand(B, 1, T, L), seen)
        for b, slot in enumerate(batch.slot_ids):  # the map follows the rows written
            self.rows[slot] += [fresh[b][r] for r in sorted(fresh[b])]
        return replace(batch, rows=rows, attn_mask=mask[..., :kv_len].contiguous(), kv_len=kv_len,
                       starts=None, ends=None, committed_run=False)

    def _packed(self, slot: int, fresh: dict[int, int]) -> bool:
        """Whether the slot's positions sit at rows of the same number and its new rows follow them."""
        mapped = self.rows[slot]  # increasing: the identity when its last entry is its length - 1
        return (not mapped or mapped[-1] == len(mapped) - 1) and all(r == p for p, r in fresh.items())

    def _repack(self, slot: int, need: int) -> None:
        """Move the slot's mapped rows down to rows 0..n-1 (position order), so that `need` more fit."""
        mapped = self.rows[slot]
        self.kv.compact(slot, mapped, 0)
        self.rows[slot] = list(range(len(mapped)))
        self.kv.lengths[slot] = len(mapped)
        if len(mapped) + need > self.kv.max_len:
            self.kv.ensure_capacity(len(mapped) + need)
