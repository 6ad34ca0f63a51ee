"""The slot state of a model with sliding-window layers (Gemma 3's local layers, Mistral v0.1,
Qwen2 with use_sliding_window): the global layers' rows in a KVCache as ever, each sliding layer's
in a ring of its window (ring_cache.py: W - 1 + R rows a slot, whatever the context).

The same calls as every state (models/state.py): lengths, set_length, compact, copy_rows,
can_copy_prefix, ensure_capacity, grow_slots, free_rows, max_len, scratch_row, nbytes. An
attention layer finds its rows by `ring(layer)` (a sliding layer: its ring and index there) or
`attention_index(layer)` (a global one: its KVCache layer), as a hybrid's attention layers do.
The masked full cache (a KVCache of every layer, models/sliding.py's masks) is the reference
(`config sliding_ring=off`); tests/test_sliding_ring.py holds the two to the same logits.

Bytes: `bytes_per_token()` what each position costs in the global layers; `bytes_per_slot()` the
rings' fixed cost a slot. Gemma 3 270M (18 layers, 15 of them sliding with W 512, 1 K/V head of
256, float32): 2 KiB a position a layer, so 36 KiB a token with every row kept, 6 KiB a token plus
15 x 767 x 2 KiB (23 MiB) a slot with the rings.
"""

from __future__ import annotations

from .kv_cache import KVCache
from .ring_cache import RingKV
from .state import OnKVRows


class SlidingState(OnKVRows):
    def __init__(self, kv: KVCache, rings: dict[int, RingKV], layers: list[tuple[int, int]], query_groups: int):
        """layers[l]: (window, index) of model layer l: window 0 and its KVCache layer for a global
        layer, else its ring's window and its index in that ring."""
        self.kv, self.rings = kv, rings
        self._layers = layers
        self.query_groups = query_groups  # query heads per K/V head (the masks' folding)

    @classmethod
    def build(cls, windows: list[int], num_slots: int, max_len: int, kv_heads: int, head_dim: int, query_groups: int,
              dtype, device, rows: int | None = None) -> "SlidingState":
        """windows[l]: layer l's window (0: global). rows: R, each ring's rows past a slot's length
        a forward writes without growing (ring_cache.ROWS, at most the window, by default)."""
        from .ring_cache import ROWS

        layers, counts = [], {}
        for w in windows:
            layers.append((w, counts.get(w, 0)))
            counts[w] = counts.get(w, 0) + 1
        kv = KVCache(counts.pop(0, 0), num_slots, max_len, kv_heads, head_dim, dtype, device)
        rings = {w: RingKV(n, num_slots, w, rows or min(ROWS, w), kv_heads, head_dim, dtype, device, max_len)
                 for w, n in sorted(counts.items())}
        return cls(kv, rings, layers, query_groups)

    def ring(self, layer: int) -> tuple[RingKV, int] | None:
        """A sliding layer's ring and its index there; None for a global layer."""
        window, index = self._layers[layer]
        return (self.rings[window], index) if window else None

    def attention_index(self, layer: int) -> int:
        """The KVCache layer of global layer `layer`."""
        window, index = self._layers[layer]
        if window:
            raise ValueError(f"layer {layer} is a sliding layer: its rows are in a ring")
        return index

    def set_length(self, slot: int, length: int) -> None:
        for ring in self.rings.values():  # first: a ring may refuse (its window's rows written over)
            ring.keep(slot, length)
        self.kv.set_length(slot, length)

    def compact(self, slot: int, src_rows: list[int], dst_start: int) -> None:
        for ring in self.rings.values():
            ring.compact(slot, src_rows, dst_start)
        self.kv.compact(slot, src_rows, dst_start)

    def copy_rows(self, src_slot: int, dst_slot: int, n: int) -> None:
        for ring in self.rings.values():
            ring.copy_prefix(src_slot, dst_slot, n)
        self.kv.copy_rows(src_slot, dst_slot, n)

    def can_copy_prefix(self, src_slot: int, n: int) -> bool:
        return all(ring.can_copy_prefix(src_slot, n) for ring in self.rings.values())

    def ensure_capacity(self, slot_rows: int) -> None:
        self.kv.ensure_capacity(slot_rows)
        for ring in self.rings.values():
            ring.scratch_row = self.kv.scratch_row

    def grow_slots(self, num_slots: int) -> None:
        self.kv.grow_slots(num_slots)
        for ring in self.rings.values():
            ring.grow_slots(num_slots)

    def nbytes(self) -> int:
        return self.kv.nbytes() + sum(ring.nbytes() for ring in self.rings.values())

    def bytes_per_token(self) -> int:
        """What one more position of a slot costs: the global layers' K and V rows."""
        return sum(2 * t.shape[1] * t.shape[3] * t.element_size() for t in self.kv.k)

    def bytes_per_slot(self) -> int:
        """The rings' bytes a slot (scratch rows included), whatever its length."""
        return sum(ring.nbytes() for ring in self.rings.values()) // max(self.num_slots, 1)

    # a KVCache's per-row reads do not apply: a ring keeps a window, not a prefix
    def keys(self, *args, **kwargs):
        raise TypeError("a sliding-window state keeps its sliding layers' rows in rings, not as a prefix "
                        "(config sliding_ring=off keeps every row)")

    gather = gather_from = write_slot = keys
