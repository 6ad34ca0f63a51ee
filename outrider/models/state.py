"""A sequence's model state behind one interface, whatever its layers keep.

What the engine, drafters, controllers and training need of a slot's state:

    state.lengths[slot]                 positions held (host ints; never read from the device)
    state.set_length(slot, n)           keep the first n positions (a rejected round: n unchanged;
                                        a commit: more; 0: empty the slot)
    state.compact(slot, rows, start)    the accepted tree path `rows` becomes positions start, ...
    state.copy_rows(src, dst, n)        the first n positions of slot src into slot dst
    state.can_copy_prefix(src, n)       whether copy_rows can give exactly those n
    state.ensure_capacity(rows), grow_slots(n), free_rows(slot), max_len, scratch_row, num_slots
    state.nbytes()                      bytes held

`KVCache` (kv_cache.py) is the state of a model made only of attention layers: rows written by
position, cut back by a length. `HybridState` below joins it (for the attention layers) with a
`DeltaState` (delta_state.py: gated-delta layers, a state that cannot be cut back, whose tree
rows are held until a commit folds the accepted path). `SlidingState` (sliding_state.py) joins a
KVCache (the global layers) with rings that keep only the rows a sliding window still reads
(ring_cache.py). `PagedKVCache` (paged_cache.py) is one more implementation of the same calls for
a model of plain attention layers: rows in pages of one pool through a block table, whole pages
shared by reference with copy on write (--kv-memory; the others keep their per-slot stores).
"""

from __future__ import annotations

from .delta_state import DeltaState
from .kv_cache import KVCache


class OnKVRows:
    """A state whose slots, lengths and rows are its KVCache's (`self.kv`): the other stores it
    joins (a DeltaState, rings) follow that cache's lengths."""

    kv: KVCache

    @property
    def lengths(self) -> list[int]:
        return self.kv.lengths

    @property
    def num_slots(self) -> int:
        return self.kv.num_slots

    @property
    def max_len(self) -> int:
        return self.kv.max_len

    @property
    def scratch_row(self) -> int:
        return self.kv.scratch_row

    def free_rows(self, slot: int) -> int:
        return self.kv.free_rows(slot)


class HybridState(OnKVRows):
    def __init__(self, kv: KVCache, delta: DeltaState, attention_layers: list[int], num_layers: int):
        self.kv, self.delta = kv, delta
        self._at = {layer: i for i, layer in enumerate(attention_layers)}  # model layer -> K/V layer
        self.num_layers = num_layers

    def attention_index(self, layer: int) -> int:
        """The K/V layer of model layer `layer` (an attention layer)."""
        return self._at[layer]

    # attention layers read and write their rows as in a KVCache: per model layer, None for the others
    @property
    def k(self) -> list:
        return [self.kv.k[self._at[l]] if l in self._at else None for l in range(self.num_layers)]

    @property
    def v(self) -> list:
        return [self.kv.v[self._at[l]] if l in self._at else None for l in range(self.num_layers)]

    def set_length(self, slot: int, length: int) -> None:
        self.delta.keep(slot, length)  # first: it may refuse (a recurrent state is not cut back)
        self.kv.set_length(slot, length)

    def compact(self, slot: int, src_rows: list[int], dst_start: int) -> None:
        self.kv.compact(slot, src_rows, dst_start)
        self.delta.commit_path(slot, src_rows, dst_start)

    def copy_rows(self, src_slot: int, dst_slot: int, n: int) -> None:
        self.delta.copy_prefix(src_slot, dst_slot, n)
        self.kv.copy_rows(src_slot, dst_slot, n)

    def can_copy_prefix(self, src_slot: int, n: int) -> bool:
        return self.delta.can_copy_prefix(src_slot, n)

    def ensure_capacity(self, slot_rows: int) -> None:
        self.kv.ensure_capacity(slot_rows)

    def grow_slots(self, num_slots: int) -> None:
        self.kv.grow_slots(num_slots)
        self.delta.grow_slots(num_slots)

    def nbytes(self) -> int:
        return self.kv.nbytes() + self.delta.nbytes()
