"""A drafter's own multi-slot K/V cache: one slot per running sequence, for batched drafting.

A model drafter (model.py, eagle3.py) keeps the K/V of every sequence it drafts for in ONE
`KVCache`, so that a draft depth is one forward for the whole batch (models/batch.py packs the
slots; the decoder attends over their span as a view). A sequence takes a slot at `start` and
gives it back at `finish`; the lowest free slot is taken first, so the running sequences' slots
stay close together and the span has few holes.

When every slot is taken the state grows to twice the slots (`grow_slots`: the stored rows copied
over, rare, at most log2(peak batch) times a run); rows per slot grow by doubling
(`ensure_capacity`). The state is whatever the model keeps (models/state.py): K/V rows, or a
hybrid's gated-delta state beside them.
"""

from __future__ import annotations

import heapq
from typing import Callable

from ..models.kv_cache import KVCache

MakeCache = Callable[[int, int], KVCache]  # (num_slots, max_len) -> an empty state (a KVCache or HybridState)


class SlotCache:
    def __init__(self, make: MakeCache, slots: int = 4, rows: int = 256):
        self.make = make
        self.cache = make(slots, rows)
        self._free = list(range(slots))  # a heap: the lowest free slot first

    def take(self) -> int:
        """A free slot, its length set to 0; the cache doubles its slots when none is free."""
        if not self._free:
            self._grow(2 * self.cache.num_slots)
        slot = heapq.heappop(self._free)
        self.cache.set_length(slot, 0)
        return slot

    def give(self, slot: int) -> None:
        self.cache.set_length(slot, 0)
        heapq.heappush(self._free, slot)

    def ensure_rows(self, rows: int) -> None:
        self.cache.ensure_capacity(rows)

    def _grow(self, num_slots: int) -> None:
        old = self.cache.num_slots
        self.cache.grow_slots(num_slots)  # the state keeps what every slot holds
        self._free.extend(range(old, num_slots))
        heapq.heapify(self._free)
