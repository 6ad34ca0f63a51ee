"""Paged K/V: attention rows in fixed-size pages of one pool, found through a block table.

The same state calls as `KVCache` (kv_cache.py): lengths on the host, `set_length`, `compact`,
`copy_rows`, `write`, `span`, `gather`, `keys`. What differs is where a slot's row lives:

    k[layer], v[layer]: [G, num_pages + 1, P, D]   the pool; page num_pages is the scratch page
    table: [num_slots, max_pages] long              slot s, row r -> page table[s, r // P], row r % P
    held[s]: the pages slot s holds, in order (the host copy of its table row)

A slot holds only the pages its rows reach (`reserve`, or a write past them), so memory follows
the tokens a request has, not `max_len`; `set_length(slot, 0)` gives its pages back. Table entries
past a slot's pages point to the scratch page, where padded tokens write: attention reads it
only at masked columns (finite values times a zero weight), so the result equals the slot cache's.

`copy_rows` shares the source's whole pages by reference (a count per page) and copies the
partial last one; a write into a page held by more than one slot first copies it (copy on
write), so sharing never changes what another slot reads. The prefix cache (engine/prefix_cache.py)
holds pages the same way (`hold`, `drop`, `share`: a count each holder), and gives back the pages
only it holds when the pool runs short (`reclaim`, asked by `reserve`, copy on write and `make_free`).

Attention over pages: `span` gathers a span's pages into [S, G, L, D] (one row gather a layer for
K and for V, read as a view: the torch layers' path, exact; heads first in the pool, so a slot's
gathered pages are its rows in order). The native decoder layer reads the pages in place
(paged_native.py): `row_map` spells the block table out a row at a time, once a forward for every
layer, and the kernel finds each key and value row through it and writes new rows through it;
no row is copied. The slow reference beside it (paged_native.SlotCopy, `read_in_place = False`)
copies each layer's span out in slot layout and writes the new rows back. Both give the slot
cache's bits: the kernel's operations do not depend on where a row lives.
"""

from __future__ import annotations

import heapq

import torch
import torch.nn.functional as F


class OutOfPages(RuntimeError):
    """The pool has no free page for a row a slot must hold."""


class PagedKVCache:
    paged = True

    def __init__(self, num_layers: int, num_slots: int, max_len: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, num_pages: int, page_size: int = 16):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"a paged cache needs at least one page of at least one row, got {num_pages} x "
                             f"{page_size}")
        shape = (kv_heads, num_pages + 1, page_size, head_dim)
        # zeros: a page not yet written is read (masked) as finite values
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.page_size, self.num_pages, self.scratch_page = page_size, num_pages, num_pages
        self.max_len = max_len
        self.scratch_row = max_len
        self.lengths = [0] * num_slots
        self.held: list[list[int]] = [[] for _ in range(num_slots)]
        self.refs = [0] * num_pages  # slots holding each page
        self._free = list(range(num_pages))  # a heap: the lowest free page first
        self.table = torch.full((num_slots, self._max_pages()), num_pages, dtype=torch.long, device=device)
        self._mapped = None  # (rows tensor, version, page [B, T], offset [B, T]) of the last write
        self._version = 0  # bumped whenever a table entry changes
        self._read = None  # (what, length, version) and the table rows a read covers
        self._picks = None  # (those rows, the pool rows they pick)
        self._copy = None  # SlotCopy's buffers (one layer's span, K and V), kept across forwards
        self._rowmap = None  # (span, length, version) and the row map the native layer reads pages through
        self.read_in_place = True  # the native layer reads the pages through the row map; False: SlotCopy
        self.reclaim = None  # reclaim(n): free up to n pages held by no slot (the prefix cache's), or None

    def _max_pages(self) -> int:
        return -(-(self.max_len + 1) // self.page_size)

    # -- the pool ---------------------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return len(self.lengths)

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def pages_used(self) -> int:
        return self.num_pages - len(self._free)

    def pages_for(self, rows: int) -> int:
        """Pages that hold `rows` rows."""
        return -(-rows // self.page_size)

    def page_bytes(self) -> int:
        """Bytes one page takes over every layer, K and V."""
        if not self.k:
            return 0
        per = self.k[0][:, 0].numel() * self.k[0].element_size()
        return 2 * len(self.k) * per

    def pages_needed(self, slot: int, rows: int) -> int:
        """New pages slot `slot` needs to hold `rows` rows."""
        return max(self.pages_for(rows) - len(self.held[slot]), 0)

    def reserve(self, slot: int, rows: int) -> None:
        """Hold pages for rows 0 .. rows - 1 of `slot`; OutOfPages when the pool cannot give them
        (then it holds what it held before)."""
        need = self.pages_needed(slot, rows)
        if need > self.make_free(need):
            raise OutOfPages(f"slot {slot} needs {need} more K/V pages for {rows} rows, {len(self._free)} are free")
        for _ in range(need):
            page = heapq.heappop(self._free)
            self.refs[page] = 1
            self.table[slot, len(self.held[slot])] = page
            self.held[slot].append(page)
        if need:
            self._version += 1

    def _release_from(self, slot: int, keep: int) -> None:
        """Give back slot `slot`'s pages past its first `keep`."""
        dropped = self.held[slot][keep:]
        if not dropped:
            return
        for page in dropped:
            self.refs[page] -= 1
            if self.refs[page] == 0:
                heapq.heappush(self._free, page)
        del self.held[slot][keep:]
        self.table[slot, keep:] = self.scratch_page
        self._version += 1

    def _own(self, slot: int, index: int) -> None:
        """Copy on write: slot `slot`'s page number `index` becomes its own before it is written."""
        page = self.held[slot][index]
        if self.refs[page] == 1:
            return
        if not self.make_free(1):
            raise OutOfPages(f"slot {slot} must copy a shared K/V page before writing it, and no page is free")
        fresh = heapq.heappop(self._free)
        for cache in (*self.k, *self.v):
            cache[:, fresh] = cache[:, page]
        self.refs[page] -= 1
        self.refs[fresh] = 1
        self.held[slot][index] = fresh
        self.table[slot, index] = fresh
        self._version += 1

    def make_free(self, n: int) -> int:
        """Free pages, after asking `reclaim` for what is short of n."""
        if n > len(self._free) and self.reclaim is not None:
            self.reclaim(n - len(self._free))
        return len(self._free)

    def hold(self, page: int) -> None:
        """One more holder of `page` (the prefix cache keeping a slot's page)."""
        self.refs[page] += 1

    def drop(self, page: int) -> None:
        """One holder fewer: the page is free when it was the last."""
        self.refs[page] -= 1
        if self.refs[page] == 0:
            heapq.heappush(self._free, page)

    def take(self, n: int) -> list[int]:
        """n free pages held by the caller (no slot), lowest first; OutOfPages when fewer are free."""
        if n > self.make_free(n):
            raise OutOfPages(f"{n} K/V pages asked for, {len(self._free)} are free")
        pages = [heapq.heappop(self._free) for _ in range(n)]
        for page in pages:
            self.refs[page] = 1
        return pages

    def share(self, slot: int, pages: list[int]) -> None:
        """Slot `slot`'s first len(pages) pages become `pages`, by reference (what it held there given
        back): a prefix's rows without a copy; a later write into one copies it first."""
        held = self.held[slot]
        for index, page in enumerate(pages):
            self.hold(page)
            if index < len(held):
                self.drop(held[index])
                held[index] = page
            else:
                held.append(page)
            self.table[slot, index] = page
        self._version += 1

    # -- the state calls --------------------------------------------------------------------------
    def free_rows(self, slot: int) -> int:
        return self.max_len - self.lengths[slot]

    def set_length(self, slot: int, length: int) -> None:
        """Keep the first `length` rows; 0 gives the slot's pages back. A cut back keeps the pages
        (the next round writes them again)."""
        if not 0 <= length <= self.max_len:
            raise ValueError(f"slot {slot}: length {length} outside [0, {self.max_len}]")
        self.lengths[slot] = length
        if length == 0:
            self._release_from(slot, 0)

    def compact(self, slot: int, src_rows: list[int], dst_start: int) -> None:
        """KVCache.compact: rows `src_rows` (increasing) to dst_start, dst_start + 1, ..."""
        moves = [(s, dst_start + i) for i, s in enumerate(src_rows) if s != dst_start + i]
        if not moves or not self.k:
            return
        P = self.page_size
        for d in {d // P for _, d in moves}:
            self._own(slot, d)
        held = self.held[slot]
        src_page = torch.tensor([held[s // P] for s, _ in moves], device=self.k[0].device)
        src_off = torch.tensor([s % P for s, _ in moves], device=self.k[0].device)
        dst_page = torch.tensor([held[d // P] for _, d in moves], device=self.k[0].device)
        dst_off = torch.tensor([d % P for _, d in moves], device=self.k[0].device)
        for cache in (*self.k, *self.v):
            rows = cache[:, src_page, src_off]  # [G, m, D], a copy
            cache[:, dst_page, dst_off] = rows

    def copy_rows(self, src_slot: int, dst_slot: int, n: int) -> None:
        """Rows 0..n-1 of `src_slot` into `dst_slot` (which holds no pages): its whole pages shared
        by reference, the partial last page copied."""
        self._release_from(dst_slot, 0)
        P = self.page_size
        whole, rest = divmod(n, P)
        for index in range(whole):
            page = self.held[src_slot][index]
            self.refs[page] += 1
            self.table[dst_slot, index] = page
            self.held[dst_slot].append(page)
        self._version += 1
        if rest:
            self.reserve(dst_slot, n)
            src, dst = self.held[src_slot][whole], self.held[dst_slot][whole]
            for cache in (*self.k, *self.v):
                cache[:, dst, :rest] = cache[:, src, :rest]

    def can_copy_prefix(self, src_slot: int, n: int) -> bool:
        return True

    def ensure_capacity(self, slot_rows: int) -> None:
        """Let a slot reach `slot_rows` rows (a wider table; no page is taken)."""
        if slot_rows <= self.max_len:
            return
        self.max_len = max(slot_rows, 2 * self.max_len)
        self.scratch_row = self.max_len
        wider = torch.full((self.num_slots, self._max_pages()), self.scratch_page, dtype=torch.long,
                           device=self.table.device)
        wider[:, : self.table.shape[1]] = self.table
        self.table = wider
        self._version += 1

    def grow_slots(self, num_slots: int) -> None:
        if num_slots <= self.num_slots:
            return
        more = torch.full((num_slots - self.num_slots, self.table.shape[1]), self.scratch_page, dtype=torch.long,
                          device=self.table.device)
        self.table = torch.cat((self.table, more))
        self.held += [[] for _ in range(num_slots - self.num_slots)]
        self.lengths += [0] * (num_slots - len(self.lengths))
        self._version += 1

    def nbytes(self) -> int:
        """The pool's bytes (every page, held or free)."""
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def held_bytes(self) -> int:
        """Bytes of the pages slots hold now."""
        return self.pages_used * self.page_bytes()

    # -- what an attention layer writes and reads ------------------------------------------------
    def _map(self, slots: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each written row's page and offset ([B, T] long each), taking pages the rows reach and
        copying shared pages they write; made once a forward (every layer writes the same rows)."""
        m = self._mapped
        if m is not None and m[0] is rows and m[1] == self._version:
            return m[2], m[3]
        P = self.page_size
        padding = rows == self.scratch_row  # [B, T]
        for slot, written in zip(slots.tolist(), torch.where(padding, -1, rows).tolist()):
            real = [r for r in written if r >= 0]
            if not real:
                continue
            self.reserve(slot, max(real) + 1)
            for index in range(min(real) // P, max(real) // P + 1):
                self._own(slot, index)
        at = rows.clamp(0, self.table.shape[1] * P - 1)
        page = torch.where(padding, self.scratch_page, self.table[slots.unsqueeze(1), at // P])  # [B, T]
        offset = torch.where(padding, 0, at % P)  # [B, T]
        self._mapped = (rows, self._version, page, offset)
        return page, offset

    def write(self, layer: int, slots: torch.Tensor, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [B, T, G, D] to rows[b, t] (long [B, T]) of slots[b] (long [B])."""
        page, offset = self._map(slots, rows)
        # the indexed view: [G, B, T, D]
        self.k[layer][:, page, offset] = k.to(self.k[layer].dtype).permute(2, 0, 1, 3)
        self.v[layer][:, page, offset] = v.to(self.v[layer].dtype).permute(2, 0, 1, 3)

    def write_slot(self, layer: int, slot: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [G, m, D] to rows start .. start + m - 1 of one slot."""
        rows = torch.arange(start, start + k.shape[1], device=self.table.device).view(1, -1)
        slots = torch.tensor([slot], device=self.table.device)
        self.write(layer, slots, rows, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0))

    def _pages(self, cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
        """The first `length` rows of each table row's pages: table [S, n] -> [S, G, length, D] (a view
        of one copy: the pool seen as [G (pages + 1), P D] rows, each head's pages picked as rows)."""
        S, n = table.shape
        G, pages, P, D = cache.shape
        m = self._picks
        if m is None or m[0] is not table:  # the same picks for every layer of a forward
            heads = torch.arange(G, device=table.device).view(G, 1) * pages  # [G, 1]
            m = self._picks = (table, (heads + table.reshape(1, S * n)).reshape(G * S * n))
        picked = F.embedding(m[1], cache.view(G * pages, P * D))  # [G S n, P D]: a row copy each
        return picked.view(G, S, n * P, D).transpose(0, 1)[:, :, :length]

    def gather(self, layer: int, slots: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of `slots` (long [S]), rows 0 .. length - 1: [S, G, L, D] copies."""
        table = self._span_table(("slots", tuple(slots.tolist())), length)
        return self._pages(self.k[layer], table, length), self._pages(self.v[layer], table, length)

    def span(self, layer: int, first: int, size: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of slots first .. first + size - 1, rows 0 .. length - 1: [S, G, L, D],
        gathered from their pages (the reference: a copy)."""
        table = self._span_table(("span", first, size), length)
        return self._pages(self.k[layer], table, length), self._pages(self.v[layer], table, length)

    def _span_table(self, which: tuple, length: int) -> torch.Tensor:
        """The block-table rows a read covers ([S, pages for length]), one tensor for every layer of a
        forward (so their picks are made once) until the table changes."""
        key = (which, length, self._version)
        if self._read is None or self._read[0] != key:
            n = self.pages_for(length)
            rows = self.table[which[1]: which[1] + which[2]] if which[0] == "span" else self.table[list(which[1])]
            self._read = (key, rows[:, :n].contiguous())
        return self._read[1]

    def keys(self, layer: int, slot: int, length: int) -> torch.Tensor:
        """A slot's first `length` keys of a layer, [G, length, D] (a copy)."""
        return self._pages(self.k[layer], self.table[slot: slot + 1, : self.pages_for(length)], length)[0]

    def slot_rows(self, pool: torch.Tensor, slot: int, first: int, m: int) -> torch.Tensor:
        """Rows first .. first + m - 1 of `slot` in `pool` (one of k, v): [G, m, D] (a copy; the
        prefix cache keeps them)."""
        return self._pages(pool, self.table[slot: slot + 1, : self.pages_for(first + m)], first + m)[0, :, first:]

    def row_map(self, batch) -> tuple[torch.Tensor, int]:
        """The native layer's way into the pages for `batch` (attention.h KVPages): map [S, L + 1] long,
        S = batch.span_size, L = batch.kv_len, row j of span slot s (kv head 0) at value map[s, j] of
        each layer's pool (map[s, L]: the scratch page's first row, where padding writes), and the
        values between kv heads. The pages the batch's rows reach are taken and shared ones copied
        first (`_map`); one map for every layer of a forward, remade when the table changes."""
        self._map(batch.slots, batch.rows)
        S, first, L = batch.span_size, batch.span_first, batch.kv_len
        key = (first, S, L, self._version)
        if self._rowmap is None or self._rowmap[0] != key:
            P, D = self.page_size, self.k[0].shape[3]
            j = torch.arange(L, device=self.table.device)
            rows = torch.empty(S, L + 1, dtype=torch.long, device=self.table.device)  # [S, L + 1]
            rows[:, :L] = self.table[first: first + S][:, j // P] * (P * D) + (j % P) * D
            rows[:, L] = self.scratch_page * P * D
            self._rowmap = (key, rows)
        return self._rowmap[1], self.k[0].stride(0)

    def gather_from(self, source, src_slot: int, dst_slot: int, kept: torch.Tensor) -> None:
        raise ValueError("a paged K/V cache is not a drafter's own cache (sparsespec keeps a slot cache of its own)")

