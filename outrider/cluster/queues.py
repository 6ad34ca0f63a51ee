"""Each replica's slots and its queue at the router: a request goes to its replica when a slot is
free there, the lowest `Policy.priority` first.

The router sends a replica at most `max_running` sequences (its engine's slots); the requests
routed to it beyond that wait here, not in the engine, so the policy orders them (OUTLETS'
shortest predicted job first, with aging: the priority is asked again each time a slot frees),
and a request still waiting when its replica dies has never reached it. A job of more choices
than the slots goes alone when the replica is empty. Pure bookkeeping: no Ray, no clock, no
locks (the router holds its lock around every call).
"""

from __future__ import annotations

from typing import Callable, Hashable


class ReplicaQueues:
    def __init__(self, slots: list[int], priority: Callable[[Hashable], float]):
        """slots: each replica's max_running; priority(item): lower goes first (asked when a slot frees)."""
        self.slots = slots
        self.priority = priority
        self.running = [0] * len(slots)  # sequences sent to each replica and not finished
        self.waiting: list[dict] = [{} for _ in slots]  # item -> its sequences, in arrival order
        self._size: dict = {}  # item -> (replica, sequences, running?)

    def add(self, replica: int, item: Hashable, n: int) -> bool:
        """Route `item` (n sequences) to `replica`; True when it may be sent now, else it waits."""
        now = not self.waiting[replica] and self._fits(replica, n)
        self._size[item] = (replica, n, now)
        if now:
            self.running[replica] += n
        else:
            self.waiting[replica][item] = n
        return now

    def remove(self, item: Hashable) -> list:
        """`item` finished, failed or was cancelled: free its slots or its place. Returns the items
        that may be sent now, in the order they were admitted."""
        entry = self._size.pop(item, None)
        if entry is None:
            return []
        replica, n, running = entry
        if running:
            self.running[replica] -= n
        else:
            self.waiting[replica].pop(item, None)
        return self._admit(replica)

    def evict(self, replica: int) -> list:
        """A dead replica's waiting items, taken out (the router sends them elsewhere)."""
        items = list(self.waiting[replica])
        for item in items:
            self._size.pop(item, None)
        self.waiting[replica].clear()
        return items

    def queued(self, replica: int) -> int:
        return sum(self.waiting[replica].values())

    def _fits(self, replica: int, n: int) -> bool:
        return self.running[replica] == 0 or self.running[replica] + n <= self.slots[replica]

    def _admit(self, replica: int) -> list:
        admitted = []
        waiting = self.waiting[replica]
        while waiting:
            item = min(waiting, key=self.priority)  # ties: the earliest (dicts keep arrival order)
            if not self._fits(replica, waiting[item]):
                break
            n = waiting.pop(item)
            self.running[replica] += n
            self._size[item] = (replica, n, True)
            admitted.append(item)
        return admitted
