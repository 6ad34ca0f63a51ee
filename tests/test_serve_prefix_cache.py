"""What a user of `outrider serve` sees of the prefix cache (issue 42, item 3): OpenAI's
usage.prompt_tokens_details.cached_tokens, the Prometheus counters under vLLM's names, /health
and the startup line; and the same text with the cache as without it."""

from __future__ import annotations

import json

import httpx
import pytest

from outrider import config
from outrider.serve.server import ServeOptions, prefix_cache_line
from test_native_layer import make_family
from test_serve_api import LiveServer, metric
from tiny import add_tokenizer

PROMPT = [3 + (i * 7) % 90 for i in range(30)]  # 29 rows prefilled: 3 whole blocks of 8


@pytest.fixture(scope="module")
def native_prefill():
    """The native layer's prefill (the same bits in any chunks), where the cache is exact."""
    with config.overriding(amx_prefill=False, gemm_prefill="off"):
        yield


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return add_tokenizer(make_family("llama", tmp_path_factory.mktemp("serve-prefix") / "llama"))


@pytest.fixture(scope="module")
def server(folder, native_prefill):
    srv = LiveServer(folder, dtype="q4", prefix_cache_block=8, chunk_size=16, api_key="sk-test")
    yield srv
    srv.close()


def post(srv, body: dict, chat: bool = False) -> dict:
    r = httpx.post(srv.url + ("/v1/chat/completions" if chat else "/v1/completions"),
                   headers={"Authorization": "Bearer sk-test"}, json={**body, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_repeated_prompt_reports_its_cached_tokens_and_the_counters_move(server):
    assert server.state.worker.engine.prefix_cache is not None, server.state.worker.engine.prefix_cache_note
    queries = metric(server, "outrider:prefix_cache_queries_total")
    hits = metric(server, "outrider:prefix_cache_hits_total")
    first = post(server, {"prompt": PROMPT, "max_tokens": 6})
    again = post(server, {"prompt": PROMPT, "max_tokens": 6})
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": 24}
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert metric(server, "outrider:prefix_cache_queries_total") == queries + 2 * len(PROMPT)
    assert metric(server, "outrider:prefix_cache_hits_total") == hits + 24
    health = httpx.get(server.url + "/health").json()["prefix_cache"]
    assert health["enabled"] and health["block_tokens"] == 8 and health["hits"] >= 24 and health["blocks"] >= 3
    assert 0 < metric(server, "outrider:prefix_cache_usage_perc") <= 1


def test_a_chats_next_turn_and_a_stream_report_the_cache(server):
    turn = [{"role": "user", "content": " ".join(f"w{t}" for t in PROMPT[:20])}]
    first = post(server, {"messages": turn, "max_tokens": 8}, chat=True)
    history = turn + [first["choices"][0]["message"], {"role": "user", "content": "w5 w6 w7"}]
    with httpx.stream("POST", server.url + "/v1/chat/completions", headers={"Authorization": "Bearer sk-test"},
                      json={"messages": history, "max_tokens": 8, "temperature": 0, "stream": True,
                            "stream_options": {"include_usage": True}}) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: {")]
    use = json.loads(events[-1][6:])["usage"]
    assert use["prompt_tokens_details"]["cached_tokens"] >= 24  # the first turn's prompt and answer


def test_the_startup_line_says_what_the_cache_is(server):
    on = ServeOptions(prefix_cache_block=8)
    assert prefix_cache_line(on, server.state.worker).startswith("prefix cache on: blocks of 8 tokens")
    assert prefix_cache_line(ServeOptions(prefix_cache=False), server.state.worker) == \
        "prefix cache off (--no-prefix-cache)"
