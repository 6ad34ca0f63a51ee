"""`outrider serve` on loopback, called with the official openai client (and httpx for raw bodies)."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import httpx
import pytest
import torch
import uvicorn

from outrider.llm import LLM
from outrider.serve.server import ServeOptions, build

if TYPE_CHECKING:  # openai is imported where used: about 1 s of CPU in every process that only collects
    import openai

KEY = "sk-test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """The app on a free loopback port, uvicorn in a background thread."""

    def __init__(self, folder, **options):
        self.port = free_port()
        opts = ServeOptions(model=str(folder), port=self.port, device="cpu", threads=1, **options)
        app, self.state = build(opts)
        self.state.worker.start()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline, "the server did not start"
            time.sleep(0.02)
        self.name = self.state.model_name

    def client(self, key=KEY) -> openai.OpenAI:
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=60)

    def close(self):
        self.server.should_exit = True
        self.thread.join(10)
        self.state.worker.stop()


@pytest.fixture(scope="module")
def tiny(tiny_folders):
    return tiny_folders["llama"]


@pytest.fixture(scope="module")
def server(tiny):
    srv = LiveServer(tiny, drafter="ngram", controller="fixed:3", api_key=KEY, max_running=6, chunk_size=16)
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def offline(tiny, server):
    torch.set_num_threads(1)
    return LLM(str(tiny), device="cpu")


def words(i: int, n: int = 6) -> str:
    g = torch.Generator().manual_seed(i)
    return " ".join(f"w{int(t)}" for t in torch.randint(3, 96, (n,), generator=g))


def metric(srv: LiveServer, name: str, labels: str = "") -> float:
    text = httpx.get(srv.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", line)
        if m and all(part in m.group(1) for part in labels.split(",") if part):
            total += float(m.group(2))
    return total


def test_health_models_and_api_key(server):
    import openai

    assert httpx.get(server.url + "/health").json() == {"status": "ok"}  # no key needed
    assert [m.id for m in server.client().models.list().data] == [server.name]
    with pytest.raises(openai.AuthenticationError):
        server.client(key="wrong").models.list()
    for method, path in (("GET", "/metrics"), ("GET", "/v1/models"), ("POST", "/v1/completions")):
        r = httpx.request(method, server.url + path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_completion_and_chat_equal_offline_generate(server, offline):
    client = server.client()
    out = client.completions.create(model=server.name, prompt=words(1), max_tokens=12, temperature=0)
    assert out.choices[0].text == offline.generate(words(1), 12).text
    assert out.usage.completion_tokens == len(offline.generate(words(1), 12).token_ids)
    ext = out.model_extra["outrider"]
    assert ext["tau"] == pytest.approx(out.usage.completion_tokens / ext["rounds"], abs=1e-9) or ext["tau"] >= 1
    chat = client.chat.completions.create(model=server.name, messages=[{"role": "user", "content": words(2)}],
                                          max_tokens=10, temperature=0)
    assert chat.choices[0].message.content == offline.generate(words(2), 10, chat=True).text
    assert chat.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("chat", [False, True])
def test_stream_text_equals_whole_text_with_stop_strings(server, offline, chat):
    client = server.client()
    full = offline.generate(words(3), 16, chat=chat).text
    stop = full.split()[4] if len(full.split()) > 4 else None
    offline_out = offline.generate(words(3), 16, chat=chat, stop=stop)
    expected = offline_out.text
    kwargs = dict(model=server.name, max_tokens=16, temperature=0, stop=stop)
    if chat:
        messages = [{"role": "user", "content": words(3)}]
        whole = client.chat.completions.create(messages=messages, **kwargs).choices[0].message.content
        chunks = list(client.chat.completions.create(messages=messages, stream=True,
                                                     stream_options={"include_usage": True}, **kwargs))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        whole = client.completions.create(prompt=words(3), **kwargs).choices[0].text
        chunks = list(client.completions.create(prompt=words(3), stream=True,
                                                stream_options={"include_usage": True}, **kwargs))
        streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == whole == expected
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(offline_out.token_ids)
    assert chunks[-2].choices[0].finish_reason in ("stop", "length") and "outrider" in chunks[-2].model_extra


def test_bad_requests_get_openai_errors(server):
    import openai

    url, auth = server.url + "/v1/completions", {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    cases = [
        (b"{not json", 400, None),
        (json.dumps({"prompt": "w3", "max_tokens": -1}), 400, "max_tokens"),
        (json.dumps({"prompt": "w3", "temperature": "hot"}), 400, "temperature"),
        (json.dumps({"prompt": "w3", "stream": "yes"}), 400, "stream"),
        (json.dumps({"prompt": 5}), 400, "prompt"),
        (json.dumps({"prompt": "w3", "n": 2, "temperature": 0}), 400, "n"),  # vLLM: n > 1 needs sampling
        (json.dumps({"prompt": " ".join(["w5"] * 300), "max_tokens": 4}), 400, "prompt"),  # context is 256
        (json.dumps({"prompt": "w3", "model": "gpt-4"}), 404, "model"),
        (json.dumps(["w3"]), 400, None),
    ]
    for body, status, param in cases:
        r = httpx.post(url, content=body, headers=auth)
        assert r.status_code == status, (body, r.text)
        error = r.json()["error"]
        assert error["message"] and error["type"] and error["param"] == param, (body, error)
    with pytest.raises(openai.BadRequestError):
        server.client().completions.create(model=server.name, prompt="w3", max_tokens=-1)


def test_sixteen_concurrent_clients_each_equal_offline(server, offline):
    prompts = [words(10 + i, 3 + i % 7) for i in range(16)]

    def ask(i):
        extra = {"speculate": False} if i % 4 == 0 else {"max_draft_tokens": 1} if i % 4 == 1 else {}
        r = server.client().completions.create(model=server.name, prompt=prompts[i], max_tokens=10,
                                               temperature=0, extra_body=extra)
        return r.choices[0].text

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(ask, range(16)))
    for p, text in zip(prompts, got):
        assert text == offline.generate(p, 10).text


def test_metrics_agree_with_per_request_stats(server):
    names = ["request_success_total", "generation_tokens_total", "spec_decode_num_draft_tokens_total",
             "spec_decode_num_accepted_tokens_total", "spec_decode_num_drafts_total"]
    before = {n: metric(server, f"outrider:{n}") for n in names}
    per_pos_before = [metric(server, "outrider:spec_decode_num_accepted_tokens_per_pos_total", f'position="{d}"')
                      for d in range(3)]
    outs = [server.client().completions.create(model=server.name, prompt=words(40 + i), max_tokens=12,
                                               temperature=0) for i in range(3)]
    ext = [o.model_extra["outrider"] for o in outs]
    delta = {n: metric(server, f"outrider:{n}") - before[n] for n in names}
    assert delta["request_success_total"] == 3
    assert delta["generation_tokens_total"] == sum(o.usage.completion_tokens for o in outs)
    assert delta["spec_decode_num_draft_tokens_total"] == sum(e["drafted"] for e in ext) > 0
    assert delta["spec_decode_num_accepted_tokens_total"] == sum(e["accepted"] for e in ext)
    assert delta["spec_decode_num_drafts_total"] == sum(e["draft_rounds"] for e in ext) > 0
    for d in range(3):
        got = metric(server, "outrider:spec_decode_num_accepted_tokens_per_pos_total", f'position="{d}"')
        assert got - per_pos_before[d] == sum((e["accepted_by_position"] + [0] * 3)[d] for e in ext)
    assert metric(server, "outrider:time_to_first_token_seconds_count") >= 3
    assert metric(server, "outrider:num_requests_running") == 0


@pytest.fixture(scope="module")
def long_tiny(tmp_path_factory):
    """A tiny model with room for 8,000 tokens: a request that cannot end before what a test
    watches for happens, however fast or loaded the machine (200 tokens of the 256-position model
    ended by length first in CI, in the disconnect test twice and in the full-queue test once)."""
    from tiny import add_tokenizer, make_tiny

    return add_tokenizer(make_tiny("llama", tmp_path_factory.mktemp("long") / "llama", max_positions=8192))


@pytest.fixture(scope="module")
def long_server(long_tiny):
    srv = LiveServer(long_tiny, api_key=KEY, max_running=2, max_model_len=8192)
    yield srv
    srv.close()


def test_client_that_disconnects_mid_stream_frees_its_slot(long_server):
    server = long_server
    aborted = metric(server, "outrider:request_success_total", 'finished_reason="abort"')
    body = {"prompt": words(50), "max_tokens": 8000, "temperature": 0, "stream": True, "ignore_eos": True,
            "speculate": False}
    with httpx.stream("POST", server.url + "/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
    deadline = time.time() + 20
    while metric(server, "outrider:request_success_total", 'finished_reason="abort"') == aborted:
        assert time.time() < deadline, "the cancelled request never ended"
        time.sleep(0.05)
    assert server.state.worker.engine.num_running == 0
    assert metric(server, "outrider:generation_tokens_total") > 0


def test_full_queue_gets_429_with_retry_after(long_tiny):
    srv = LiveServer(long_tiny, max_running=1, max_queue=1, max_model_len=8192)
    try:
        body = {"model": srv.name, "prompt": words(60), "max_tokens": 1500, "ignore_eos": True, "temperature": 0,
                "speculate": False}
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(httpx.post, srv.url + "/v1/completions", json=body, timeout=60)
            while srv.state.worker.engine.num_running < 1:
                time.sleep(0.01)
            second = pool.submit(httpx.post, srv.url + "/v1/completions", json=body, timeout=60)
            while srv.state.worker.queued < 1:
                time.sleep(0.01)
            r = httpx.post(srv.url + "/v1/completions", json=body)
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "rate_limit_error"
            assert first.result().status_code == second.result().status_code == 200
    finally:
        srv.close()
