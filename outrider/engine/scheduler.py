"""Continuous batching: which requests hold a slot of the K/V cache.

Between rounds the engine asks the scheduler to admit waiting requests and tells it which ones
finished. A request holds one slot and reserves the K/V rows it may use (prompt + max new
tokens + one round's draft tree, at most a slot's rows). Admission is first come, first served:
the head of the queue is admitted as soon as a slot is free and its rows fit under the row
limit; nothing behind it jumps ahead (so a large request waits but is never starved), and
nothing is dropped. Admitted requests take the lowest free slot, which keeps the running slots
packed at the bottom of the cache (the forward attends over the span covering them, batch.py).
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Protocol


class Slotted(Protocol):
    slot: int  # -1 while waiting
    rows: int  # K/V rows reserved while running


class Scheduler:
    def __init__(self, num_slots: int, max_kv_rows: int):
        if num_slots < 1 or max_kv_rows < 1:
            raise ValueError(f"need at least one slot and one K/V row, got {num_slots} slots, {max_kv_rows} rows")
        self.num_slots = num_slots
        self.max_kv_rows = max_kv_rows
        self.waiting: deque[Slotted] = deque()
        self.running: list[Slotted] = []  # in admission order
        self.rows_reserved = 0
        self._free = list(range(num_slots))  # a heap: the lowest free slot first

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

    def drop_waiting(self, entry: Slotted) -> None:
        """A waiting request was cancelled before it got a slot."""
        self.waiting.remove(entry)
