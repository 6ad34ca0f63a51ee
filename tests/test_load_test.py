"""scripts/load_test.py end to end on a tiny model: a real `outrider serve` subprocess on loopback,
two closed-loop concurrencies with speculation off and on, HumanEval prompts from the fixtures;
and the client's outcome rules against a fake server that misbehaves."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import threading
from pathlib import Path

import pytest

from outrider.bench.serve_load import Target, closed_loop, percentiles, summarize

ROOT = Path(__file__).resolve().parent.parent


def load_script():
    spec = importlib.util.spec_from_file_location("load_test", ROOT / "scripts" / "load_test.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quick_run_on_a_tiny_model_writes_results_and_plot(tiny_folders, tmp_path, monkeypatch, capsys, runtime):
    runtime(bench_fixtures=str(ROOT / "tests" / "fixtures"))
    out = tmp_path / "out"
    argv = ["--quick", "--model", str(tiny_folders["llama"]), "--drafter", "ngram", "--controller", "fixed:3",
            "--concurrency", "1,2", "--rates", "", "--requests", "2", "--phase-time", "0.01", "--min-requests", "2", "--max-tokens", "6",
            "--threads", "1", "--out", str(out)]
    assert load_script().main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    assert (out / "load.png").stat().st_size > 10_000 and results["server_exit_status"] == 0
    phases = results["phases"]
    assert [(p["kind"], p["concurrency"], p["mode"]) for p in phases] == [
        ("closed", 1, "off"), ("closed", 1, "on"), ("closed", 2, "off"), ("closed", 2, "on")]
    for p in phases:
        assert p["requests"] == p["ok"] == 2 and p["errors"] == p["lost"] == 0
        assert p["metrics"]["agree"] and p["metrics"]["generation_tokens"] == p["output_tokens"] > 0
        assert p["throughput_tok_s"] > 0 and p["ttft_s"]["p50"] <= p["ttft_s"]["p99"]
    # off and on send the same prompts; each concurrency fresh ones (prompt 0 warmed the server up)
    assert [[r["prompt"] for r in p["records"]] for p in phases] == [[1, 2], [1, 2], [3, 4], [3, 4]]
    assert not any(p["prompts_reused"] for p in phases)
    off, on = phases[0], phases[1]
    assert off["tau"] == 1.0 and on["tau"] >= 1.0 and on["acceptance"] >= 0  # off really did not draft
    assert sum(r["drafted"] for r in off["records"]) == 0 < sum(r["drafted"] for r in on["records"])
    goals = results["goals"]
    assert goals["spec_on_over_off_c1"]["value"] == pytest.approx(on["throughput_tok_s"] / off["throughput_tok_s"])
    assert goals["scaling_c16_over_c1_spec_off"]["met"] is None and goals["soak"]["met"] is None
    assert goals["no_errors_no_lost"] == {"errors": 0, "lost": 0, "metrics_agree": True}
    assert "| closed, 2 clients | on | 2 / 2 | 0 | 0 |" in capsys.readouterr().out


def test_bad_flags_are_one_line_errors(capsys):
    script = load_script()
    assert script.main(["--concurrency", "1,x"]) == 2
    assert script.main(["--modes", "sometimes"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --concurrency takes comma-separated numbers, got '1,x'",
                   "error: --modes takes off and/or on, got ['sometimes']"]


class FakeServer:
    """A loopback HTTP server whose nth request gets the nth canned reply (raw bytes, then close)."""

    def __init__(self, replies: list[bytes]):
        import socket

        self.replies = replies
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        for reply in self.replies:
            conn, _ = self.sock.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(reply)


def sse(status: str, *events: str) -> bytes:
    body = "".join(f"data: {e}\n\n" for e in events).encode()
    return (f"HTTP/1.1 {status}\r\nContent-Type: text/event-stream\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode() + body


def test_outcomes_ok_error_and_lost():
    text = json.dumps({"choices": [{"text": "a", "finish_reason": None}]})
    end = json.dumps({"choices": [{"text": "", "finish_reason": "length"}], "outrider": {"rounds": 2, "drafted": 3,
                                                                                      "accepted": 1}})
    use = json.dumps({"choices": [], "usage": {"completion_tokens": 3, "prompt_tokens": 5}})
    replies = [
        sse("200 OK", text, end, use, "[DONE]"),  # ok
        sse("200 OK", text, end, "[DONE]"),  # no usage chunk: lost
        sse("200 OK", text),  # cut short: lost
        sse("429 Too Many Requests", json.dumps({"error": {"message": "full"}})),  # error
        sse("200 OK", json.dumps({"error": {"message": "engine failed"}})),  # error event
    ]
    server = FakeServer(replies)
    target = Target(server.url, ["p"], chat=False, max_tokens=3, request_timeout=10)
    records, wall = asyncio.run(closed_loop(target, 1, len(replies), 30))
    assert [r.outcome for r in records] == ["ok", "lost", "lost", "error", "error"]
    assert records[0].output_tokens == 3 and records[0].rounds == 2 and records[0].tpot is not None
    assert "HTTP 429" in records[3].error and records[4].error == "engine failed"
    s = summarize(records, wall)
    assert (s["ok"], s["errors"], s["lost"], s["output_tokens"], s["tau"]) == (1, 2, 2, 3, 1.5)


def test_percentiles_interpolate():
    assert percentiles([]) == {"p50": None, "p99": None, "mean": None}
    got = percentiles([float(x) for x in range(1, 102)])  # 1..101
    assert got == {"p50": 51.0, "p99": 100.0, "mean": 51.0}
