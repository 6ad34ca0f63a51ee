"""`outrider serve --replicas 2` on a tiny model: two Ray actors behind one HTTP front end.

One Ray instance and one cluster for the module (Ray starts in seconds, each replica loads the
model): the outputs equal one engine's, sessions stick, /metrics has each replica's series and
their sums, a request moved between replicas mid-stream continues unbroken, and, last, a replica
killed under load loses no request: each is answered in full (retried once on the other replica)
or fails with an error naming the dead replica; then a new actor takes its slot and serves."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

ray = pytest.importorskip("ray")
import uvicorn  # noqa: E402

from tiny import add_tokenizer, make_tiny  # noqa: E402

from outrider.cluster.backend import build  # noqa: E402
from outrider.engine.generate import offline_engine  # noqa: E402
from outrider.engine.request import Request  # noqa: E402
from outrider.errors import ConfigError  # noqa: E402
from outrider.llm import LLM  # noqa: E402
from outrider.sampling import SamplingParams  # noqa: E402
from outrider.serve.server import ServeOptions  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_local():
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    yield
    ray.shutdown()


class Cluster:
    """The cluster's app on a free loopback port, uvicorn in a background thread."""

    def __init__(self, folder, **options):
        port = free_port()
        opts = ServeOptions(model=str(folder), port=port, device="cpu", threads=1, replicas=2, **options)
        self.log: list[str] = []
        app, self.state = build(opts, log=lambda *a, **k: self.log.append(" ".join(map(str, a))))
        self.router = self.state.worker
        self.router.start()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 60
        while not self.server.started:
            assert time.time() < deadline, "the server did not start"
            time.sleep(0.02)

    def complete(self, prompt: str, max_tokens: int, stream: bool = False, session: str | None = None,
                 user: str | None = None, headers: dict | None = None, **extra):
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
                **({"user": user} if user else {}), **extra}
        headers = {**({"X-Session-Id": session} if session else {}), **(headers or {})}
        r = httpx.post(self.url + "/v1/completions", json=body, headers=headers, timeout=30)
        if not stream:
            return r.status_code, r.json()
        events = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        errors = [e["error"] for e in events if "error" in e]
        if errors:
            return 503, {"error": errors[0]}
        return r.status_code, {"choices": [{"text": "".join(e["choices"][0]["text"] for e in events)}]}

    def metric(self, name: str, labels: str = "", summed: bool = False) -> float:
        """The value of `name` over series holding every `labels` part; summed: only the series
        without a replica label (the cluster's sums)."""
        total = 0.0
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            m = re.match(rf"^{re.escape(name)}(?:\{{([^}}]*)\}})? (\S+)$", line)
            if not m:
                continue
            got = m.group(1) or ""
            if summed and "replica=" in got:
                continue
            if all(part in got for part in labels.split(",") if part):
                total += float(m.group(2))
        return total

    def close(self):
        self.server.should_exit = True
        self.thread.join(10)
        self.router.stop()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama with a long context: the kill test's first stream runs for seconds."""
    return add_tokenizer(make_tiny("llama", tmp_path_factory.mktemp("cluster") / "llama", max_positions=4096))


@pytest.fixture(scope="module")
def cluster(tiny, ray_local):
    c = Cluster(tiny, drafter="ngram", controller="fixed:3", policy="sticky:max_skew=2", max_running=1,
                max_model_len=4096)
    yield c
    c.close()


@pytest.fixture(scope="module")
def offline(tiny, cluster):
    torch.set_num_threads(1)
    return LLM(str(tiny), device="cpu")


def words(i: int, n: int = 6) -> str:
    g = torch.Generator().manual_seed(i)
    return " ".join(f"w{int(t)}" for t in torch.randint(3, 96, (n,), generator=g))


def test_two_replicas_give_one_engines_greedy_tokens_and_share_the_load(cluster, offline):
    prompts = [words(i) for i in range(6)]
    with ThreadPoolExecutor(6) as pool:
        outs = list(pool.map(lambda i: cluster.complete(prompts[i], 24, stream=i % 2 == 1), range(6)))
    for prompt, (status, body) in zip(prompts, outs):
        assert status == 200, body
        assert body["choices"][0]["text"] == offline.generate(prompt, 24).text
    routed = [cluster.metric("outrider:cluster_requests_routed_total", f'replica="{i}"') for i in (0, 1)]
    assert sum(routed) == 6 and min(routed) >= 1, routed  # max_running 1: least-load spreads them
    assert httpx.get(cluster.url + "/health").json() == {"status": "ok", "replicas": 2, "replicas_alive": 2,
                                                         "replica_restarts": 0}
    assert any("replica 0: pid" in line and "replica 1: pid" in line for line in cluster.log)  # where they run


def test_a_session_stays_on_its_replica(cluster):
    """The session is the X-Session-Id header, or else the OpenAI `user` field."""
    before = cluster.metric("outrider:cluster_requests_routed_total", 'reason="sticky"')
    for _ in range(3):
        assert cluster.complete(words(7), 4, session="alice")[0] == 200
    for _ in range(2):
        assert cluster.complete(words(8), 4, user="bob")[0] == 200
    assert cluster.metric("outrider:cluster_requests_routed_total", 'reason="sticky"') == before + 3
    for session in ("alice", "bob"):
        assert sum(session in v.sessions for v in cluster.router.views) == 1


def test_metrics_per_replica_and_summed(cluster):
    """Each replica's counters under its label, the cluster's sums beside them; counted from what
    this test sends (the module's cluster has served the tests before it, or none of them)."""
    ended_before = cluster.metric("outrider:request_success_total", summed=True)
    with ThreadPoolExecutor(4) as pool:  # at once, so that least-load gives each replica some (max_running 1)
        outs = list(pool.map(lambda i: cluster.complete(words(8 + i), 10), range(4)))
    assert all(status == 200 for status, _ in outs)
    # a replica's counters reach its metrics just after the answer reaches the client: let them settle
    deadline = time.time() + 10
    while time.time() < deadline and (
            cluster.metric("outrider:request_success_total", summed=True) != ended_before + 4
            or cluster.metric("outrider:num_requests_running", summed=True) != 0):
        time.sleep(0.1)
    name = "outrider:generation_tokens_total"
    per = [cluster.metric(name, f'replica="{i}"') for i in (0, 1)]
    assert per[0] > 0 and per[1] > 0
    assert cluster.metric(name, summed=True) == sum(per)
    ended = [cluster.metric("outrider:request_success_total", f'replica="{i}"') for i in (0, 1)]
    assert cluster.metric("outrider:request_success_total", summed=True) == sum(ended) == ended_before + 4
    assert cluster.metric("outrider:num_requests_running", summed=True) == 0
    assert cluster.metric("outrider:cluster_replicas", 'state="alive"') == 2


def test_an_unknown_policy_is_refused_before_ray_starts_anything(tiny):
    with pytest.raises(ConfigError, match="unknown policy 'fastest'"):
        build(ServeOptions(model=str(tiny), replicas=2, policy="fastest"))


def test_a_request_moved_mid_stream_continues_on_the_other_replica(cluster, offline):
    """A stream is moved (router.move) once its client has text: cancelled on its replica and
    continued from its committed tokens on the other. Greedy, and sampled with a seed, the client's
    text is the unmoved run's (LLM.generate's), no token lost or sent twice: the continuation keeps
    the seed and the positions its draws are keyed by. Its X-Rollout-Group reaches the router."""
    moved = cluster.metric("outrider:cluster_requests_moved_total")
    for params in ({"temperature": 0}, {"temperature": 0.9, "seed": 11}):
        prompt, out = words(50 + len(params)), {}
        first_text = threading.Event()

        def stream():
            body = {"prompt": prompt, "max_tokens": 400, "stream": True, "ignore_eos": True, **params}
            with httpx.stream("POST", cluster.url + "/v1/completions", json=body, timeout=30,
                              headers={"X-Rollout-Group": "step-1"}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        event = json.loads(line[6:])
                        assert "error" not in event, event
                        out.setdefault("text", []).append(event["choices"][0]["text"])
                        first_text.set()

        runner = threading.Thread(target=stream)
        runner.start()
        assert first_text.wait(30), "the stream sent no text"
        (request_id, replica, group), = cluster.router.requests()
        assert group == "step-1"
        cluster.router.move(request_id, 1 - replica)
        runner.join(60)
        request = Request(offline.encode(prompt), 400, SamplingParams(**params), ignore_eos=True)
        unmoved = offline_engine(offline.target, [request], offline.eos_ids, decode=offline.decode).run_all([request])
        assert "".join(out["text"]) == unmoved[0].text, params
    assert cluster.metric("outrider:cluster_requests_moved_total") == moved + 2


def test_a_bad_routing_header_is_a_400(cluster):
    status, body = cluster.complete(words(3), 4, headers={"X-Workload": "w" * 300})
    assert status == 400 and body["error"]["message"] == "the X-Workload header is 300 characters long; at most 256"


def test_killing_a_replica_under_load_loses_no_request(cluster, offline):
    """A long stream runs on replica 0 (one slot a replica) and has sent text; more requests
    arrive, some wait behind it; replica 0 is killed. The stream fails naming replica 0 (its
    client has part of the text); the waiting ones are re-sent to replica 1 and answered in full.
    Runs last: it leaves one replica."""
    first_text = threading.Event()

    def long_stream():
        body = {"prompt": words(19), "max_tokens": 3000, "temperature": 0, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", cluster.url + "/v1/completions", json=body, timeout=30) as r:
            events = []
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
                    first_text.set()
        return events

    n, tokens = 7, 40
    prompts = [words(20 + i) for i in range(n)]
    routed0 = cluster.metric("outrider:cluster_requests_routed_total", 'replica="0"')
    with ThreadPoolExecutor(n + 1) as pool:
        stream = pool.submit(long_stream)  # both idle: replica 0, the lowest index
        assert first_text.wait(30), "the long stream sent no text"
        futures = [pool.submit(cluster.complete, prompts[i], tokens, i % 2 == 1) for i in range(n)]
        deadline = time.time() + 30
        while cluster.metric("outrider:cluster_requests_routed_total", 'replica="0"') < routed0 + 2:
            assert time.time() < deadline, "no request was sent to replica 0 behind the long stream"
            time.sleep(0.01)
        ray.kill(cluster.router.replicas[0])
        outs = [f.result() for f in futures]
        events = stream.result()
    assert "error" in events[-1], events[-1]
    assert events[-1]["error"]["code"] == "replica_died" and "replica 0 died" in events[-1]["error"]["message"]
    for prompt, (status, body) in zip(prompts, outs):
        assert status == 200, body
        assert body["choices"][0]["text"] == offline.generate(prompt, tokens).text
    assert cluster.metric("outrider:cluster_requests_retried_total") >= 1
    assert cluster.metric("outrider:cluster_requests_failed_total", 'reason="replica_died"') == 1
    assert cluster.metric("outrider:cluster_replica_deaths_total", 'replica="0"') == 1
    assert any("replica 0 died" in line for line in cluster.log)
    status, body = cluster.complete(words(40), 6)  # the survivor serves
    assert (status, body["choices"][0]["text"]) == (200, offline.generate(words(40), 6).text)
    # a new actor takes replica 0's slot (--replica-restarts, 2 by default) and serves
    deadline = time.time() + 120
    while httpx.get(cluster.url + "/health").json()["replicas_alive"] < 2:
        assert time.time() < deadline, f"replica 0 was not restarted: {cluster.log[-3:]}"
        time.sleep(0.2)
    assert httpx.get(cluster.url + "/health").json() == {"status": "ok", "replicas": 2, "replicas_alive": 2,
                                                         "replica_restarts": 1}
    assert any("replica 0 restarted (1 of 2 restarts): replica 0: pid" in line for line in cluster.log)
    routed0 = cluster.metric("outrider:cluster_requests_routed_total", 'replica="0"')
    status, body = cluster.complete(words(41), 6)  # both idle: replica 0, the lowest index
    assert (status, body["choices"][0]["text"]) == (200, offline.generate(words(41), 6).text)
    assert cluster.metric("outrider:cluster_requests_routed_total", 'replica="0"') == routed0 + 1
    assert cluster.metric("outrider:cluster_replica_restarts_total", 'replica="0"') == 1
    assert cluster.metric("outrider:cluster_replicas", 'state="alive"') == 2
