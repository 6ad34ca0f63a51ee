"""Continuous batching: which requests hold a slot of the K/V cache.

Between rounds the engine asks the scheduler to admit waiting requests and tells it which ones
finished. A request holds one slot and reserves the K/V rows it may use (prompt + max new
tokens + one round's draft tree, at most a slot's rows). Admission is first come, first served:
the head of the queue is admitted as soon as a slot is free and its rows fit under the row
limit; nothing behind it jumps ahead (so a large request waits but is never starved), and
nothing is dropped. Admitted requests take the lowest free slot, which keeps the running slots
packed at the bottom of the cache (the forward attends over the span covering them, batch.py).
With a paged cache, `take(entry, slot)` is asked too (engine/paging.py: whether the K/V pages
of its prefill are free; then the slot takes them), and a running request may be preempted: it
goes back to the head of the queue.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Protocol


class Slotted(Protocol):
    slot: int  # -1 while waiting
    rows: int  # K/V rows reserved while running


class Scheduler:
    def __init__(self, num_slots: int, max_kv_rows: int, take=None):
        if num_slots < 1 or max_kv_rows < 1:
            raise ValueError(f"need at least one slot and one K/V row, got {num_slots} slots, {max_kv_rows} rows")
        self.num_slots = num_slots
        self.max_kv_rows = max_kv_rows
        self.waiting: deque[Slotted] = deque()
        self.running: list[Slotted] = []  # in admission order
        self.rows_reserved = 0
        self._free = list(range(num_slots))  # a heap: the lowest free slot first
        self.take = take  # (entry, slot) -> bool: False, the head waits (None: slots and rows only)

    def add(self, entry: Slotted) -> None:
        if entry.rows > self.max_kv_rows:
            raise ValueError(f"a request reserving {entry.rows} K/V rows can never fit under {self.max_kv_rows}")
        self.waiting.append(entry)

    def can_allocate(self, entry: Slotted) -> bool:
        return bool(self._free) and self.rows_reserved + entry.rows <= self.max_kv_rows

    def admit(self) -> list[Slotted]:
        """Move waiting requests into free slots, in arrival order, while they fit."""
        admitted = []
        while self.waiting and self.can_allocate(self.waiting[0]):
            if self.take is not None and not self.take(self.waiting[0], self._free[0]):
                break
            entry = self.waiting.popleft()
            entry.slot = heapq.heappop(self._free)
            self.rows_reserved += entry.rows
            self.running.append(entry)
            admitted.append(entry)
        return admitted

    def release(self, entry: Slotted) -> None:
        """A running request finished: its slot and rows are free for the next round."""
        self.running.remove(entry)
        heapq.heappush(self._free, entry.slot)
        self.rows_reserved -= entry.rows

    def preempt(self, entry: Slotted) -> None:
        """A running request gives its slot and rows up and waits again, first in the queue."""
        self.release(entry)
        entry.slot = -1
        self.waiting.appendleft(entry)

    def drop_waiting(self, entry: Slotted) -> None:
        """A waiting request was cancelled before it got a slot."""
        self.waiting.remove(entry)
