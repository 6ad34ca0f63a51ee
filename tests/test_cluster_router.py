"""The router on fake replicas (no Ray processes): a policy's Decision reaches the engine
requests, observe() hears the outcome, and a replica dying before or after its client saw output
is retried once or failed by name; a job is never left without an answer."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

ray = pytest.importorskip("ray")

from outrider.cluster.metrics import ClusterMetrics  # noqa: E402
from outrider.cluster.policies import POLICIES, make_policy  # noqa: E402
from outrider.cluster.policy import Decision, PolicyBase  # noqa: E402
from outrider.cluster.replica import Limits  # noqa: E402
from outrider.cluster.router import Router  # noqa: E402
from outrider.engine.request import Completion, Request  # noqa: E402
from outrider.serve.worker import Job, Update  # noqa: E402


class Died(Exception):
    pass


class FakeReplica:
    """Answers each job with `script`: "ok" (one update, then done), "dies" (before any output) or
    "dies-late" (after one update); records the requests it was sent."""

    def __init__(self, script: str):
        self.script, self.received, self.cancelled, self.sessions = script, [], [], []
        self.gate: asyncio.Future | None = None  # "gated": its first job waits for this ("ok" or "die")
        replica = self

        class Method:
            def options(self, **_):
                return self

            def remote(self, key, requests, prefill_from, grammars, session, stream=True):
                replica.received.append(requests)
                replica.sessions.append(session)
                return replica.stream(requests)

        class Cancel:
            def remote(self, key):
                replica.cancelled.append(key)

        self.run, self.cancel = Method(), Cancel()

    async def stream(self, requests):
        if self.script == "dies" or (self.script == "gated" and len(self.received) == 1 and await self.gate == "die"):
            raise ray.exceptions.ActorDiedError()
        yield asyncio.sleep(0, result=[("update", Update(0, 1, "w3"))])
        if self.script == "dies-late":
            raise ray.exceptions.ActorDiedError()
        done = Completion("w3 w4", [3, 4], "length", stats={"mean_accepted_length": 2.0})
        yield asyncio.sleep(0, result=[("done", (i, done)) for i in range(len(requests))])


@dataclass
class PlainOnOne(PolicyBase):
    """Every request to replica 1, without speculation; remembers what it observed."""

    name: str = "plain-on-one"

    def __post_init__(self):
        self.outcomes = []

    def route(self, request, replicas, now):
        return Decision(1, speculate=False, reason="test")

    def observe(self, outcome):
        self.outcomes.append(outcome)


def run_job(scripts: list[str], policy, stream: bool) -> tuple[list, Router, list, list[str]]:
    """One job through a router over fake replicas; (its queue items, router, replicas, log)."""
    replicas = [FakeReplica(s) for s in scripts]
    log: list[str] = []
    limits = Limits("tiny", 64, 256, 1, 96, 4, speculative=True)
    metrics = ClusterMetrics(replicas, alive=lambda: [])
    router = Router(replicas, limits, policy, metrics, max_queue=8, log=lambda *a, **k: log.append(a[0]))

    async def main():
        job = Job([Request([5, 6, 7], 2)], asyncio.get_running_loop())
        job.stream, job.session = stream, "s1"
        router.submit(job)
        items = []
        while True:
            kind, item = await asyncio.wait_for(job.queue.get(), 5)
            items.append((kind, item))
            if kind in ("done", "error"):
                break
        return items

    return asyncio.run(main()), router, replicas, log


def retried(router: Router) -> float:
    return router.metrics.registry.get_sample_value("outrider:cluster_requests_retried_total")


def test_the_decision_reaches_the_engine_and_the_policy_hears_the_outcome():
    policy = PlainOnOne()
    items, router, replicas, _ = run_job(["ok", "ok"], policy, stream=True)
    assert [kind for kind, _ in items] == ["update", "done"]
    assert replicas[0].received == [] and [r.speculate for r in replicas[1].received[0]] == [False]
    (outcome,) = policy.outcomes
    assert (outcome.replica, outcome.output_tokens, outcome.speculated, outcome.tau, outcome.error) == \
        (1, 2, False, 2.0, None)
    assert outcome.request.session == "s1" and outcome.request.prompt_ids == (5, 6, 7)
    assert router.views[1].sessions == {"s1"} and router.views[1].recent_tau == 2.0
    assert router.queues.running == [0, 0] and router.in_flight == 0


def test_a_replica_dying_before_output_is_retried_once_elsewhere():
    items, router, replicas, log = run_job(["dies", "ok"], make_policy("least-load"), stream=True)
    assert [kind for kind, _ in items] == ["update", "done"]
    assert len(replicas[0].received) == len(replicas[1].received) == 1
    assert [v.alive for v in router.views] == [False, True]
    assert retried(router) == 1
    assert any("replica 0 died" in line for line in log)


def test_a_job_without_stream_is_retried_even_after_its_replica_produced_tokens():
    items, router, _, _ = run_job(["dies-late", "ok"], make_policy("least-load"), stream=False)
    assert [kind for kind, _ in items] == ["done"]  # held to the end: the client saw nothing
    assert retried(router) == 1


def test_a_stream_with_output_fails_naming_the_dead_replica():
    items, router, replicas, _ = run_job(["dies-late", "ok"], make_policy("least-load"), stream=True)
    kind, err = items[-1]
    assert kind == "error" and (err.status, err.code) == (503, "replica_died")
    assert "replica 0 died" in err.message and "streamed" in err.message
    assert replicas[1].received == [] and retried(router) == 0


def test_a_retry_that_dies_too_fails_naming_both_and_the_last_death_fails_the_server():
    items, router, _, _ = run_job(["dies", "dies-late"], make_policy("least-load"), stream=False)
    kind, err = items[-1]
    assert kind == "error" and err.code == "replica_died"
    assert "replica 0 died" in err.message and "replica 1, where it was retried once, died too" in err.message
    assert router.failed == "every replica has died" and router.health() == {"replicas": 2, "replicas_alive": 0,
                                                                                "replica_restarts": 0}
    items, _, _, _ = run_job(["dies"], make_policy("least-load"), stream=False)
    assert items[-1][1].code == "no_replica" and "replica 0 died" in items[-1][1].message


@dataclass
class Ordered(PolicyBase):
    """Every job to replica 0 while it lives; its queue ordered by the job's session name."""

    name: str = "ordered"

    def route(self, request, replicas, now):
        return Decision(0 if replicas[0].alive else 1, reason="test")

    def priority(self, request, now):
        return {"A": 0, "B": 5, "C": 1}[request.session]


def run_queued(gate: str, cancel: str = "") -> tuple[Router, list]:
    """Jobs A, B, C to a one-slot replica 0 whose first job (A) waits for `gate`; B and C wait
    at the router, but those named in `cancel` are cancelled there (their clients went away).
    Returns the router and the replicas once every other job has its answer."""
    replicas = [FakeReplica("gated"), FakeReplica("ok")]
    router = Router(replicas, Limits("tiny", 64, 256, 1, 96, 1, True), Ordered(), ClusterMetrics(replicas, list),
                    max_queue=8, log=lambda *a, **k: None)

    async def main():
        replicas[0].gate = asyncio.get_running_loop().create_future()
        jobs = []
        for name in "ABC":
            job = Job([Request([5, 6, 7], 2)], asyncio.get_running_loop())
            job.session, job.stream = name, False
            router.submit(job)
            jobs.append(job)
            await asyncio.sleep(0.01)
        assert (router.views[0].running, router.views[0].queued) == (1, 2)
        assert router.metrics.registry.get_sample_value("outrider:cluster_requests_waiting", {"replica": "0"}) == 2
        for job in jobs:
            if job.session in cancel:
                router.cancel(job)
        replicas[0].gate.set_result(gate)
        answers = [await asyncio.wait_for(job.queue.get(), 5) for job in jobs if job.session not in cancel]
        await asyncio.sleep(0.01)
        return answers

    answers = asyncio.run(main())
    assert [kind for kind, _ in answers] == ["done"] * (3 - len(cancel))
    return router, replicas


def test_jobs_wait_at_the_router_for_a_slot_lowest_priority_first():
    router, replicas = run_queued("ok")
    assert replicas[0].sessions == ["A", "C", "B"] and replicas[1].sessions == []
    assert router.queues.running == [0, 0] and router.views[0].queued == 0
    assert router.metrics.registry.get_sample_value("outrider:cluster_requests_waiting", {"replica": "0"}) == 0


def test_jobs_waiting_for_a_replica_that_dies_go_to_another():
    router, replicas = run_queued("die")
    assert replicas[0].sessions == ["A"] and sorted(replicas[1].sessions) == ["A", "B", "C"]
    assert retried(router) == 3  # A ran there and showed nothing; B and C never reached it


def test_a_job_cancelled_while_it_waits_is_never_sent_and_frees_its_place():
    router, replicas = run_queued("ok", cancel="C")
    assert replicas[0].sessions == ["A", "B"]
    assert router.views[0].queued == 0 and router.in_flight == 0


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_routes_through_the_router(name):
    """Each registered policy, with its default options, takes the router's records and hears
    the outcome (the simulator drives them too: this is the production side)."""
    items, router, replicas, _ = run_job(["ok", "ok"], make_policy(name), stream=True)
    assert [kind for kind, _ in items] == ["update", "done"]
    assert sum(len(r.received) for r in replicas) == 1 and router.in_flight == 0
