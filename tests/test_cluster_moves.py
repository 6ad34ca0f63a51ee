"""Moving a request between replicas (cluster/moves.py), TailSieve's moves through the router, the
routing headers (cluster/info.py) and a restarted slot's metrics, on fake replicas (no Ray
processes).

The fake replica decodes like an engine with a deterministic "model" (the next token is a
function of the tokens so far), one token per choice per step, with the engine's own text
streams (stop strings, held-back tails) over a SentencePiece-like decode whose first word has no
leading space: text a replica makes for a continuation alone would lose a space at the cut, so
the client's text shows whether the router made it from the whole output."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

ray = pytest.importorskip("ray")

from outrider.cluster.info import request_info, with_features  # noqa: E402
from outrider.cluster.metrics import ClusterMetrics, merge  # noqa: E402
from outrider.cluster.moves import MoveError  # noqa: E402
from outrider.cluster.policies import make_policy  # noqa: E402
from outrider.cluster.policy import Decision, PolicyBase  # noqa: E402
from outrider.cluster.replica import Limits  # noqa: E402
from outrider.cluster.router import Router  # noqa: E402
from outrider.engine.request import Completion, Request, TokenLogprob  # noqa: E402
from outrider.engine.text_stream import TextStream  # noqa: E402
from outrider.sampling import SamplingParams  # noqa: E402
from outrider.serve.errors import ApiError  # noqa: E402
from outrider.serve.worker import Job, Update  # noqa: E402
from outrider.spec.types import RoundStats  # noqa: E402


def decode(ids) -> str:
    return "".join(f" w{t}" for t in ids).lstrip(" ")


def next_token(tokens) -> int:
    return (tokens[-1] * 7 + len(tokens) * 3) % 90 + 3


class StepReplica:
    """A fake replica: one token per choice per step; stops, cancels ("cancelled" with what it
    committed), token ids when asked. `pause_at`: a choice waits after that many tokens (until
    it is cancelled), so a test moves it at a known point."""

    def __init__(self, pause_at: int | None = None):
        self.pause_at, self.runs, self.cancelled = pause_at, [], set()
        replica = self

        class Run:
            def options(self, **_):
                return self

            def remote(self, key, requests, prefill_from, grammars, session, stream=True, ids=False):
                replica.runs.append((key, requests))
                return replica.stream(key, requests, stream, ids)

        class Cancel:
            def remote(self, key):
                replica.cancelled.add(key)

        self.run, self.cancel = Run(), Cancel()

    async def stream(self, key, requests, stream, ids):
        outs = [[] for _ in requests]
        texts = [TextStream(decode, r.stop) for r in requests]
        done = [False] * len(requests)
        while not all(done):
            await asyncio.sleep(0.001)
            items = []
            for j, r in enumerate(requests):
                if done[j]:
                    continue
                lps = [] if r.logprobs is not None else None
                if key in self.cancelled:
                    rest = texts[j].finish()
                    if stream and rest:
                        items.append(("update", Update(j, 0, rest)))
                    items.append(("done", (j, self.completion(texts[j].text, outs[j], "cancelled", r))))
                    done[j] = True
                    continue
                if self.pause_at is not None and len(outs[j]) >= self.pause_at:
                    continue
                before = len(outs[j])
                outs[j].append(next_token(list(r.prompt_ids) + outs[j]))
                text, reason = texts[j].add(outs[j][-1:]), None
                if texts[j].stopped:  # the stopping rules cut the tokens after the stop string's start
                    del outs[j][texts[j].kept_tokens:]
                    reason = "stop"
                elif len(outs[j]) >= r.max_new_tokens:
                    reason = "length"
                new = outs[j][before:]
                if reason is not None:
                    text += texts[j].finish()
                if ids and new:
                    items.append(("ids", (j, new)))
                if stream and (new or text):
                    items.append(("update", Update(j, len(new), text, None if lps is None else [lp(t) for t in new])))
                if reason is not None:
                    items.append(("done", (j, self.completion(texts[j].text, outs[j], reason, r))))
                    done[j] = True
            if items:
                yield asyncio.sleep(0, result=items)

    @staticmethod
    def completion(text, ids, reason, r) -> Completion:
        rounds = RoundStats(rounds=len(ids), committed=len(ids), committed_by_round=[1] * len(ids))
        return Completion(text, list(ids), reason, {"mean_accepted_length": 1.0, "total_s": 0.1}, rounds,
                          None if r.logprobs is None else [lp(t) for t in ids], None)


def lp(token: int) -> TokenLogprob:
    return TokenLogprob(token, -token / 100)


@dataclass
class To(PolicyBase):
    """Every request to one replica."""

    name: str = "to"
    replica: int = 0

    def route(self, request, replicas, now):
        return Decision(self.replica, reason="test")


def make_router(replicas, policy, max_running: int = 4, decode_=decode) -> Router:
    limits = Limits("tiny", 4096, 1 << 16, 1, 96, max_running, speculative=True)
    return Router(replicas, limits, policy, ClusterMetrics(replicas, list), max_queue=16, log=lambda *a, **k: None,
                  decode=decode_)


def job_of(loop, *requests, stream=True, headers=None) -> Job:
    job = Job(list(requests), loop)
    job.stream, job.session, job.headers = stream, None, headers or {}
    return job


async def answer(job) -> tuple[list, dict]:
    """The job's updates and its Completions by choice, as the HTTP side reads them."""
    updates, done = [], {}
    while len(done) < len(job.requests):
        kind, item = await asyncio.wait_for(job.queue.get(), 5)
        assert kind != "error", item
        if kind == "update":
            updates.append(item)
        else:
            done[item[0]] = item[1]
    return updates, done


def unmoved(*requests, stream=True) -> tuple[list, dict]:
    async def main():
        router = make_router([StepReplica()], To())
        job = job_of(asyncio.get_running_loop(), *requests, stream=stream)
        router.submit(job)
        return await answer(job)

    return asyncio.run(main())


def moved(*requests, stream=True, pause_at=4) -> tuple[list, dict, Router, list]:
    """The job on replica 0, moved to replica 1 once replica 0 has committed `pause_at` tokens a choice."""
    replicas = [StepReplica(pause_at), StepReplica()]

    async def main():
        router = make_router(replicas, To())
        job = job_of(asyncio.get_running_loop(), *requests, stream=stream)
        router.submit(job)
        while not replicas[0].runs:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.05)  # every choice has reached the pause (or its end)
        (request_id, replica, _), = router.requests()
        assert replica == 0
        router.move(request_id, 1)
        updates, done = await answer(job)
        await asyncio.sleep(0.01)
        return updates, done, router

    updates, done, router = asyncio.run(main())
    return updates, done, router, replicas


def texts_of(updates: list, index: int = 0) -> str:
    return "".join(u.text for u in updates if u.index == index)


def test_a_moved_stream_continues_token_for_token_with_its_text_unbroken():
    request = Request([5, 6, 7], 12, logprobs=0)
    ref_updates, ref = unmoved(request)
    updates, done, router, replicas = moved(request)
    assert done[0].token_ids == ref[0].token_ids and len(ref[0].token_ids) == 12
    assert texts_of(updates) == texts_of(ref_updates) == ref[0].text == done[0].text  # no space lost at the cut
    assert sum(u.tokens for u in updates) == 12  # the usage counts each token once
    assert [x.token for x in done[0].logprobs] == ref[0].token_ids
    (_, sent), = replicas[1].runs  # the continuation: prompt + the 4 committed tokens, 8 left
    assert sent[0].prompt_ids == [5, 6, 7] + ref[0].token_ids[:4] and sent[0].max_new_tokens == 8
    assert done[0].finish_reason == "length" and done[0].stats["rounds"] == 12  # both replicas' rounds
    assert router.metrics.registry.get_sample_value("outrider:cluster_requests_moved_total",
                                                    {"replica": "1", "reason": "move"}) == 1
    assert router.queues.running == [0, 0] and router.in_flight == 0


@pytest.mark.parametrize("space, kept", [("", 4), (" ", 3)])
def test_a_stop_string_across_the_cut_ends_the_moved_request_where_the_unmoved_one_ends(space, kept):
    """The old replica holds back "w{t3}" (it may begin the stop string) and flushes it when
    cancelled: that flush is not sent; the target's text alone never sees the stop string, the
    router's (the whole output) does, cuts there and stops the target. With a leading space the
    cut falls before token t3, which the old replica committed: the answer drops it, as unmoved."""
    first = unmoved(Request([5, 6, 7], 12))[1][0].token_ids
    stop = f"{space}w{first[3]} w{first[4]}"
    request = Request([5, 6, 7], 12, stop=(stop,), logprobs=0)
    ref_updates, ref = unmoved(request)
    assert ref[0].finish_reason == "stop" and len(ref[0].token_ids) == kept
    for stream in (True, False):
        updates, done, _, replicas = moved(request, stream=stream)
        assert (done[0].token_ids, done[0].text, done[0].finish_reason) == (ref[0].token_ids, ref[0].text, "stop")
        assert [x.token for x in done[0].logprobs] == ref[0].token_ids
        if stream:
            assert texts_of(updates) == texts_of(ref_updates) == ref[0].text
        assert replicas[1].runs[0][0] in replicas[1].cancelled  # the target was stopped by the router


def test_a_job_without_stream_moves_whole_and_a_finished_choice_stays_as_it_ended():
    short, long = Request([9, 4], 3), Request([5, 6, 7], 10)
    _, ref = unmoved(short, long, stream=False)
    updates, done, _, replicas = moved(short, long, stream=False)
    assert updates == []  # nothing reaches the client before the end
    assert [done[i].token_ids for i in (0, 1)] == [ref[i].token_ids for i in (0, 1)]
    assert [done[i].text for i in (0, 1)] == [ref[i].text for i in (0, 1)]
    (_, sent), = replicas[1].runs
    assert [r.prompt_ids for r in sent] == [[5, 6, 7] + ref[1].token_ids[:4]]  # only the open choice moved


def test_a_waiting_request_moves_to_the_other_queue_as_it_is():
    replicas = [StepReplica(pause_at=3), StepReplica()]

    async def main():
        router = make_router(replicas, To(), max_running=1)
        loop = asyncio.get_running_loop()
        busy, waiting = job_of(loop, Request([1, 2], 5)), job_of(loop, Request([3, 4], 5))
        router.submit(busy)
        router.submit(waiting)
        await asyncio.sleep(0.02)
        (busy_id, _, _), (waiting_id, _, _) = router.requests()
        assert router.views[0].queued == 1
        router.move(waiting_id, 1)
        result = await answer(waiting)
        router.move(busy_id, 1)  # unblock replica 0's paused job
        await answer(busy)
        return result

    updates, done = asyncio.run(main())
    assert done[0].token_ids == unmoved(Request([3, 4], 5))[1][0].token_ids
    assert [key for key, _ in replicas[0].runs] == ["job-0.0"]  # the waiting job never reached replica 0
    assert replicas[1].runs[0][1][0].prompt_ids == [3, 4]  # sent as it came: nothing to continue


def test_bad_moves_are_refused_in_one_line():
    replicas = [StepReplica(pause_at=2), StepReplica(), StepReplica()]

    async def main():
        router = make_router(replicas, To())
        loop = asyncio.get_running_loop()
        plain = job_of(loop, Request([5, 6], 8))
        penalised = job_of(loop, Request([5, 6], 8, SamplingParams(temperature=1.0, frequency_penalty=0.5)))
        for job in (plain, penalised):
            router.submit(job)
        await asyncio.sleep(0.02)
        (plain_id, _, _), (penalised_id, _, _) = router.requests()
        router.views[2].alive = False
        cases = [(plain_id, 7, "replica 7 does not exist: this cluster has replicas 0 to 2"),
                 (plain_id, "1", "replica '1' does not exist"),
                 (plain_id, 2, "replica 2 is dead: a request cannot move there"),
                 (plain_id, 0, f"request {plain_id} is on replica 0 already"),
                 ("nobody", 1, "no request 'nobody' is in flight"),
                 (penalised_id, 1, "cannot move: its presence or frequency penalty counts output tokens")]
        for request_id, replica, message in cases:
            with pytest.raises(MoveError, match=message) as err:
                router.move(request_id, replica)
            assert "\n" not in str(err.value)
        router.move(plain_id, 1)
        with pytest.raises(MoveError, match="is moving already, to replica 1"):
            router.move(plain_id, 1)
        router.decode = None
        with pytest.raises(MoveError, match="this router has no tokenizer"):
            router.move(plain_id, 1)
        for job in (plain, penalised):
            router.cancel(job)
        await asyncio.sleep(0.02)

    asyncio.run(main())


def test_tailsieve_moves_a_groups_tail_to_the_fast_replica_in_the_router():
    """tailsieve:fast=1: replica 0 is the low-latency one. Both requests of group g go to the bulk
    replica 1 and decode plainly; once the short one ends (half the group), the long one (which
    cannot end there: it pauses after 6 tokens) is moved to replica 0, speculating, and ends as it
    would have unmoved."""
    replicas = [StepReplica(), StepReplica(pause_at=6)]
    long = Request([5, 6, 7], 14)

    async def main():
        router = make_router(replicas, make_policy("tailsieve:fast=1"))
        loop = asyncio.get_running_loop()
        jobs = [job_of(loop, Request([9, 4], 3), headers={"x-rollout-group": "g"}),
                job_of(loop, long, headers={"x-rollout-group": "g"})]
        for job in jobs:
            router.submit(job)
        answers = [await answer(job) for job in jobs]
        await asyncio.sleep(0.01)
        return answers, router

    (_, short_done), (updates, long_done) = asyncio.run(main())[0]
    assert long_done[0].token_ids == unmoved(long)[1][0].token_ids
    assert [r[0].speculate for _, r in replicas[1].runs] == [False, False]  # the bulk decodes plainly
    (_, sent), = replicas[0].runs
    k = len(sent[0].prompt_ids) - 3  # the tokens it had committed when the short one ended
    assert sent[0].speculate and 0 < k <= 6 and sent[0].prompt_ids == [5, 6, 7] + long_done[0].token_ids[:k]


def test_routing_headers_fill_the_request_info_and_bad_ones_get_a_400():
    loop = asyncio.new_event_loop()
    job = job_of(loop, Request([1, 2, 3], 8), headers={"x-rollout-group": " step-7 ", "x-workload": "humaneval"})
    info = request_info(job, 1.5)
    assert (info.group, info.workload, info.prompt_tokens, info.max_tokens, info.features) == \
        ("step-7", "humaneval", 3, 8, ())
    assert request_info(job_of(loop, Request([1], 2), headers={"x-rollout-group": ""}), 0).group is None
    done = Completion("", [4, 5], "length", round_stats=RoundStats(committed_by_round=[3, 1, 2, 1, 4]))
    assert with_features(info, [done], speculated=True).features == (3.0, 1.0, 2.0, 1.0)  # the first 4 rounds
    assert with_features(info, [done], speculated=False).features == ()  # plain decoding: none
    router = make_router([StepReplica()], To())
    for headers, message in [({"x-workload": "x" * 300}, "the X-Workload header is 300 characters long; at most 256"),
                             ({"x-rollout-group": "a\x01b"}, "the X-Rollout-Group header holds a control character"),
                             ({"x-rollout-group": 7}, "the X-Rollout-Group header must be text, got int")]:
        with pytest.raises(ApiError, match=message) as err:
            router.submit(job_of(loop, Request([1], 2), headers=headers))
        assert err.value.status == 400 and "\n" not in err.value.message
    loop.close()


def test_a_restarted_slot_keeps_its_old_counters_and_drops_its_old_gauges():
    old = "# TYPE outrider:request_success counter\noutrider:request_success_total 5.0\n" \
          "# TYPE outrider:num_requests_running gauge\noutrider:num_requests_running 2.0\n"
    new = old.replace("5.0", "1.0").replace("2.0", "1.0")
    metrics = ClusterMetrics([object(), object()], alive=lambda: [0, 1])
    metrics.last = {0: old, 1: new}
    metrics.restarted(0)
    metrics.last[0] = new
    text = merge(metrics.last, {0, 1}, metrics.retired)
    assert 'outrider:request_success_total{replica="0"} 6.0' in text  # 5 before the restart + 1 since
    assert "outrider:request_success_total 7.0" in text
    assert 'outrider:num_requests_running{replica="0"} 1.0' in text  # the new actor's gauge alone
    assert metrics.registry.get_sample_value("outrider:cluster_replica_restarts_total", {"replica": "0"}) == 1
