"""Paged K/V through `outrider serve --kv-memory` and `LLM(kv_memory=...)`: the option's forms and
refusals, the startup line and /health on the pool, /metrics' K/V rows, and the text of
concurrent requests equal to the same server's with slots."""

from __future__ import annotations

import threading

import httpx
import pytest

from outrider.engine.paging import page_bytes, pages_of, parse_kv_memory
from outrider.errors import ConfigError
from outrider.serve.server import ServeOptions, kv_line
from test_serve_api import LiveServer, metric

PROMPTS = [[3 + (i * k) % 90 for i in range(9 + k)] for k in range(1, 7)]


@pytest.fixture(scope="module")
def folder(tiny_folders):
    return tiny_folders["llama"]


def _texts(srv) -> list[str]:
    """Six prompts at once, greedy: their texts in order."""
    out = [None] * len(PROMPTS)

    def one(i):
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": PROMPTS[i], "max_tokens": 10, "temperature": 0},
                       timeout=60)
        assert r.status_code == 200, r.text
        out[i] = r.json()["choices"][0]["text"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_kv_memory_takes_mib_or_pages_and_refuses_the_rest():
    assert parse_kv_memory("512") == ("mib", 512) and parse_kv_memory("512MiB") == ("mib", 512)
    assert parse_kv_memory("2000p") == ("pages", 2000) and parse_kv_memory(64) == ("mib", 64)
    for bad in ("0", "-3", "lots", "1.5", True):
        with pytest.raises(ConfigError, match="--kv-memory must be a positive number"):
            parse_kv_memory(bad)
    with pytest.raises(ConfigError, match="--kv-memory"):
        ServeOptions(kv_memory="many").check()
    with pytest.raises(ConfigError, match="--kv-page must be a positive integer"):
        ServeOptions(kv_memory="64", kv_page=0).check()


def test_a_paged_server_serves_the_slots_text_and_reports_its_pool(folder):
    slots = LiveServer(folder, max_running=6, max_model_len=64, chunk_size=8)
    try:
        expected = _texts(slots)
        assert "6 slots of 64 rows" in kv_line(slots.state.worker)
    finally:
        slots.close()
    srv = LiveServer(folder, max_running=6, max_model_len=64, chunk_size=8, kv_memory="12p", kv_page=4)
    try:
        engine = srv.state.worker.engine
        assert engine.paged and engine.cache.num_pages == 12
        assert _texts(srv) == expected
        assert kv_line(srv.state.worker).startswith("K/V: paged, 12 pages of 4 rows")
        health = httpx.get(srv.url + "/health").json()["kv_pages"]
        assert health["pages"] == 12 and health["page_rows"] == 4 and health["used"] == 0
        assert health["preemptions"] == engine.preemptions  # 48 rows for six requests of 20-26 rows: some wait
        assert metric(srv, "outrider:kv_rows_total") == 48
    finally:
        srv.close()


def test_llm_takes_kv_memory(folder):
    from outrider import LLM

    llm = LLM(str(folder), device="cpu", kv_memory="1")  # 1 MiB
    assert llm.kv_pages == pages_of("1", llm.target, 16) == (1 << 20) // page_bytes(llm.target, 16)
    paged = llm.generate(["a b c", "d e f g"], 8)
    plain = LLM(str(folder), device="cpu").generate(["a b c", "d e f g"], 8)
    assert [c.token_ids for c in paged] == [c.token_ids for c in plain]
    with pytest.raises(ConfigError, match="--kv-memory must be"):
        LLM(str(folder), device="cpu", kv_memory="x")
