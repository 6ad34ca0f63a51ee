"""Each replica's slots and its queue at the router (cluster/queues.py): pure bookkeeping."""

from __future__ import annotations

from outrider.cluster.queues import ReplicaQueues


def test_requests_wait_for_a_slot_and_go_lowest_priority_first():
    prio = {"a": 0, "b": 5, "c": 1, "d": 1}
    q = ReplicaQueues([2, 2], prio.__getitem__)
    assert q.add(0, "a", 1) and q.add(0, "x", 1)  # two slots
    assert not q.add(0, "b", 1) and not q.add(0, "c", 1) and not q.add(0, "d", 1)
    assert (q.running[0], q.queued(0)) == (2, 3)
    assert q.add(1, "y", 1)  # the other replica's slots are its own
    assert q.remove("a") == ["c"]  # the lowest priority; "d" ties with it and came later
    assert q.remove("x") == ["d"]
    assert q.remove("nobody") == [] and q.remove("c") == ["b"] and q.queued(0) == 0


def test_a_newcomer_never_passes_the_queue_and_a_big_job_goes_alone():
    q = ReplicaQueues([2], lambda item: 0)
    assert q.add(0, "a", 1)
    assert not q.add(0, "big", 3)  # more choices than slots: waits until the replica is empty
    assert not q.add(0, "small", 1)  # a slot is free, but "big" is waiting first
    assert q.remove("a") == ["big"] and q.running[0] == 3
    assert q.remove("big") == ["small"]


def test_a_dead_replicas_waiting_items_are_handed_back_and_a_cancelled_one_frees_its_place():
    q = ReplicaQueues([1], lambda item: 0)
    q.add(0, "a", 1)
    q.add(0, "b", 1)
    q.add(0, "c", 1)
    assert q.remove("b") == [] and q.queued(0) == 1  # cancelled while waiting
    assert q.evict(0) == ["c"] and q.queued(0) == 0
    assert q.remove("c") == [] and q.remove("a") == [] and q.running[0] == 0
