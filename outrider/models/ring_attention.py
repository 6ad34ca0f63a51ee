"""Attention of a sliding-window layer over its ring (ring_cache.py): which cache row each ring row
holds, the window's mask over the ring's rows, and a long causal run cut into chunks the ring holds.

    views = ring_views(batch, state, dtype, span_mask)   # window -> RingView, once a forward
    out = views[W].attend(state, layer, batch, q, k, v, scale)   # [B, H, T, D]

After a forward (or a chunk of it) has written slot b's rows up to hi_b - 1, ring row i holds cache
row r_b(i), the one row of hi_b - C .. hi_b - 1 with r = i mod C (none when r < 0). The mask over
the ring is the batch's own mask (causal, or a tree's) and the window's rule (a key at position k
is seen from a query at p only when k > p - W, models/sliding.py) read at those rows: the same
keys the masked full cache (the reference: KVCache + sliding.window_mask) lets each query see,
each at its ring row. Rows a window no longer reads may have been written over; the mask never
lets a query read one (ring_cache.py says why).

A run meant to be committed whole (ForwardBatch.committed_run: a prompt's prefill, with or without
logits, a drafter's catch-up) longer than the ring's R rows is attended R rows at a time inside
the layer: chunk [a, b) writes its rows, then its queries read the ring, which then holds every
row they see (a query at row L + t sees rows > L + t - W). The forward stays one forward (its
logits and hidden states come out whole). A later chunk writes over rows an earlier one wrote,
which is right only when every row is committed; so a forward of drafts (a verify's chain or
tree, a drafter's tree grown over several forwards), whose rows may be rejected, is never cut:
the ring grows to hold it (RingKV.fit). Cutting a slot back after all (set_length below a cut
run's end) is checked like any cut-back: allowed while the ring holds the window it needs, else
refused in one line (ring_cache.py), never read wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import sliding
from .attention_layer import SpanView
from .layers import attention, fold_mask


@dataclass(frozen=True)
class RingView:
    """What every sliding layer of one window shares in a forward: its chunks of the batch's
    columns, each [start, stop) with its mask over the ring's rows."""

    chunks: tuple[tuple[int, int, SpanView], ...]

    def attend(self, state, index: int, batch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float | None) -> torch.Tensor:
        """q [B, H, T, D], k, v [B, T, G, D] of model layer `index` -> its attention output
        [B, H, T, D]; writes the K/V rows into the layer's ring, chunk by chunk."""
        ring, layer = state.ring(index)
        slots = batch.slots
        out = []
        for start, stop, view in self.chunks:
            ring.write(layer, slots, batch.rows[:, start:stop], k[:, start:stop], v[:, start:stop])
            keys, values = ring.span(layer, view.first, view.span)  # [S, G, C, D] views
            if keys.dtype != q.dtype:  # a float16 cache (kv_dtype): its values, widened exactly
                keys, values = keys.to(q.dtype), values.to(q.dtype)
            part = q[:, :, start:stop]  # [B, H, t, D]
            if view.place is None:
                out.append(attention(part, keys, values, view.mask, view.folded, scale))
            else:  # slots with holes or out of order: queries go to their span rows (batch.py)
                B, H, t, D = part.shape
                q_span = part.new_zeros(view.span, H, t, D).index_copy_(0, view.place, part)
                out.append(attention(q_span, keys, values, view.mask, view.folded, scale).index_select(0, view.place))
        return out[0] if len(out) == 1 else torch.cat(out, dim=2)


def extents(batch, scratch_row: int) -> tuple[list[int], list[int]]:
    """Each batch row's slot length and one past the last row it writes (host ints): the batch's
    own (pack's), else read from its rows (a batch built by hand)."""
    if batch.starts is not None:
        return list(batch.starts), list(batch.ends)
    rows = batch.rows.cpu()
    real = (rows >= 0) & (rows < scratch_row)  # [B, T]
    ends = torch.where(real, rows + 1, 0).amax(1)
    starts = torch.where(real, rows, scratch_row).amin(1)
    return starts.tolist(), ends.tolist()


def ring_mask(batch, window: int, capacity: int, start: int, stop: int, hi: list[int]) -> torch.Tensor:
    """[B, 1, stop - start, C] bool: which ring rows the batch's queries start .. stop - 1 see, when
    slot b's ring holds cache rows hi[b] - C .. hi[b] - 1 (the slow reference: sliding.window_mask's
    columns r_b(i))."""
    B = batch.tokens.shape[0]
    t, C, L = stop - start, capacity, batch.kv_len
    device = batch.tokens.device
    high = torch.tensor(hi, device=device).view(B, 1)
    low = high - C
    held = low + (torch.arange(C, device=device).view(1, C) - low).remainder(C)  # [B, C]: ring row i's cache row
    at = held.clamp(0, L - 1)
    queries = batch.positions[:, start:stop].view(B, t, 1)
    if batch.attn_mask is None:  # one slot, causal, row = position: a query sees rows up to its own
        base = at.view(B, 1, C) <= batch.rows[:, start:stop].view(B, t, 1)
    else:
        base = torch.gather(batch.attn_mask[:, 0, start:stop], 2, at.view(B, 1, C).expand(B, t, C))
    if batch.key_pos is None:
        keys = at
    else:
        keys = torch.gather(batch.key_pos.expand(B, L), 1, at)  # [B, C]: each held row's position
    mask = base & sliding.in_window(keys.view(B, 1, C), queries, window) & (held >= 0).view(B, 1, C)  # [B, t, C]
    mask = mask.unsqueeze(1)
    mask[..., 0] |= ~mask.any(-1)  # padded rows see ring row 0 (finite); a real row sees itself
    return mask


def ring_views(batch, state, dtype: torch.dtype, span_mask) -> dict[int, RingView]:
    """One RingView per ring of `state` (a SlidingState) for `batch`, once a forward. Prepares the
    rings for the forward's writes: grown for a tree wider than R, each slot's last row noted.
    span_mask: decoder._span_mask, for slots with holes."""
    starts, ends = extents(batch, state.scratch_row)
    T = batch.tokens.shape[1]
    groups = state.query_groups
    views = {}
    for window, ring in state.rings.items():
        widest = max(e - s for s, e in zip(starts, ends))
        step = T
        if batch.committed_run and widest > ring.rows:  # chunks of R rows, each the ring holds
            step = ring.rows
        else:
            ring.fit(widest)
        ring.note(batch.slot_ids, ends)
        chunks = []
        for a in range(0, T, step):
            b = min(a + step, T)
            hi = [min(e, s + b) for s, e in zip(starts, ends)] if step < T else ends
            mask = ring_mask(batch, window, ring.capacity, a, b, hi)
            if batch.span_place is not None:
                mask = span_mask(mask, batch.span_place, batch.span_size)
            chunks.append((a, b, SpanView(mask, fold_mask(mask, groups, dtype), batch.span_place, batch.span_first,
                                          batch.span_size)))
        views[window] = RingView(tuple(chunks))
    return views
