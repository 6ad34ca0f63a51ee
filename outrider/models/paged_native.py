"""The native decoder layer (kernels/decoder_layer.c) over paged K/V (paged_cache.py), two ways:

    x = run_native(native, decoder, batch, paged, x, cos, sin, upto, hidden, fill=..., mass=..., mass_at=...)

In place (`paged.read_in_place`, the default): the kernel reads each key and value row where it
lives, through a row map (PagedKVCache.row_map: the block table spelt out a row at a time, made once
a forward for every layer, S (L + 1) integers), and writes the forward's new rows into their pages
through it. One native call for all the layers, no K/V row copied.

The slow reference beside it (`read_in_place = False`): SlotCopy, each layer's span copied out of
the pages in slot layout into two buffers the cache keeps, the layer run over the copy a native call
a layer, its new rows copied back into the pages.

Both give the slot cache's bits (tests/test_paged_cache.py): the kernel does the same operations on
the same values whatever the address a row is read from (attention.c's KV_ROW).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..kernels.decoder_layer import KVPages


def run_native(native, decoder, batch, paged, x: torch.Tensor, cos, sin, upto: int, hidden: dict,
               **options) -> torch.Tensor:
    """decoder's layers 0..upto-1 over x [B, T, E] by `native` (NativeLayers), reading and writing
    `paged` (a PagedKVCache): in place, or through SlotCopy; `options` as NativeLayers.run's."""
    if not paged.read_in_place:
        copy = SlotCopy(paged, batch, upto)
        x = native.run_one(decoder, copy.batch, copy, x, cos, sin, upto, hidden, **options)
        copy.write_back()
        return x
    rows, head_stride = paged.row_map(batch)  # [S, L + 1] long
    pages = KVPages(rows.data_ptr(), rows.shape[1], head_stride)
    return native.run(decoder, local_batch(batch, paged.scratch_row), paged, x, cos, sin, upto, hidden,
                      pages=pages, **options)


def local_batch(batch, scratch_row: int):
    """`batch` with its slots counted from its span's first and its padding sent to row kv_len (the
    row map's and SlotCopy's scratch row)."""
    first, L = batch.span_first, batch.kv_len
    rows = torch.where(batch.rows == scratch_row, L, batch.rows)  # [B, T]
    return replace(batch, slot_ids=[s - first for s in batch.slot_ids], rows=rows, span_first=0)


class SlotCopy:
    """A paged span in slot layout, one layer at a time: k[l], v[l] [S, G, L + 1, D] hold rows
    0 .. L - 1 of the batch's span slots in layer l (L = batch.kv_len; row L is the scratch row),
    copied out of the pages when layer l is first read, into one pair of buffers the cache keeps
    (a layer's span, not every layer's); `batch` is the same forward with its slots counted from
    the span's first and its padding sent to row L. The native layer, called a layer at a time,
    writes the new rows there and reads them with the rest: the same values at the same rows as in
    a slot cache, so the same bits. Moving to the next layer, and `write_back` after the last, copy
    the rows the forward wrote into their pages."""

    def __init__(self, paged, batch, layers: int):
        S, first, L = batch.span_size, batch.span_first, batch.kv_len
        self.paged, self.source, self.scratch_row, self.layers = paged, batch, L, layers
        self.table = paged._span_table(("span", first, S), L)
        G, _, _, D = paged.k[0].shape
        need = S * G * (L + 1) * D
        if paged._copy is None or paged._copy[0].numel() < need:  # kept: no fresh pages a forward
            paged._copy = [torch.empty(need, dtype=paged.k[0].dtype, device=paged.k[0].device) for _ in range(2)]
        self.bufs = [b[:need].view(S, G, L + 1, D) for b in paged._copy]
        self.layer = -1
        self.k, self.v = _OneLayer(self, 0), _OneLayer(self, 1)
        self.batch = local_batch(batch, paged.scratch_row)

    def load(self, layer: int) -> None:
        """Layer `layer`'s span in the buffers (the layer before written back first)."""
        if layer == self.layer:
            return
        self.write_back()
        L = self.scratch_row
        for buf, pool in zip(self.bufs, (self.paged.k[layer], self.paged.v[layer])):
            buf[:, :, :L] = self.paged._pages(pool, self.table, L)
            buf[:, :, L] = 0
        self.layer = layer

    def write_back(self) -> None:
        """The rows the forward wrote in the loaded layer, into their pages (padding into the scratch page)."""
        if self.layer < 0:
            return
        local = self.batch.slots.unsqueeze(1)  # [B, 1]
        k, v = (buf[local, :, self.batch.rows] for buf in self.bufs)  # [B, T, G, D] each
        self.paged.write(self.layer, self.source.slots, self.source.rows, k, v)
        self.layer = -1


class _OneLayer:
    """SlotCopy's k or v as the native layer indexes them: layer i loads layer i's span first."""

    def __init__(self, copy: SlotCopy, which: int):
        self.copy, self.which = copy, which

    def __getitem__(self, layer: int) -> torch.Tensor:
        if not isinstance(layer, int) or not 0 <= layer < self.copy.layers:
            raise IndexError(f"a paged span's copy gives one layer at a time, 0 .. {self.copy.layers - 1}")
        self.copy.load(layer)
        return self.copy.bufs[self.which]
