"""scripts/guidellm_serve.py without guidellm (an optional extra `make test` never installs): the
scenario and command it builds, the prompts file, the report it reads (the shape guidellm 0.8
writes), and the table; and that guidellm's request bodies are ones the server accepts."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def runner():
    spec = importlib.util.spec_from_file_location("guidellm_serve", ROOT / "scripts" / "guidellm_serve.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_scenario_and_command(runner, tmp_path):
    data = tmp_path / "prompts.jsonl"
    spec = runner.scenario("http://127.0.0.1:9000", "smollm2-135m-instruct", "/models/smol", data, [1, 4], 32, 300)
    backend = spec["spec"]["backend"]
    assert backend == {"kind": "openai_http", "target": "http://127.0.0.1:9000", "model": "smollm2-135m-instruct",
                       "request_format": "/v1/completions", "extras": {"body": {"temperature": 0}}, "timeout": 600}
    assert spec["spec"]["data"] == [{"kind": "json_file", "path": str(data)}]
    assert spec["spec"]["tokenizer"] == {"kind": "huggingface_auto", "model": "/models/smol"}  # local: no network
    assert spec["spec"]["constraints"] == [{"kind": "max_requests", "count": 32}, {"kind": "max_duration", "seconds": 300}]
    assert spec["benchmarks"] == [{"profile.streams": 1}, {"profile.streams": 4}]
    chat = runner.scenario("http://x", "m", "/t", data, [2], 8, 60, chat=True, api_key="sk")["spec"]["backend"]
    assert chat["request_format"] == "/v1/chat/completions" and chat["api_key"] == "sk"
    cmd = runner.command("/venv/bin/guidellm", tmp_path / "s.json", tmp_path / "r.json")
    assert cmd == ["/venv/bin/guidellm", "run", "--scenario", str(tmp_path / "s.json"), "--output",
                   f"kind=json,path={tmp_path / 'r.json'}", "--disable-console-interactive"]
    lines = runner.prompts_jsonl(["def f(x):", "a\nb"], 64).splitlines()
    assert [json.loads(x) for x in lines] == [{"prompt": "def f(x):", "output_tokens_count": 64},
                                              {"prompt": "a\nb", "output_tokens_count": 64}]


def _dist(p50, p99, mean, total=None):
    return {"successful": {"mean": mean, "median": p50, "total_sum": total, "percentiles": {"p50": p50, "p99": p99}}}


def test_the_report_is_read_in_seconds_and_tokens_per_second(runner):
    bench = {"config": {"strategy": {"type_": "concurrent", "streams": 4}}, "duration": 8.0,
             "metrics": {"request_totals": {"successful": 16, "errored": 0, "incomplete": 0, "total": 16},
                         "output_token_count": _dist(32, 32, 32, total=512),
                         "output_tokens_per_second": _dist(60.0, 70.0, 64.0),
                         "time_to_first_token_ms": _dist(120.0, 480.0, 150.0),
                         "inter_token_latency_ms": _dist(15.0, 30.0, 16.0),
                         "request_latency": _dist(0.6, 1.1, 0.7)}}
    [row] = runner.parse_report({"benchmarks": [bench]})
    assert row["concurrency"] == 4 and row["requests"] == {"successful": 16, "errored": 0, "incomplete": 0}
    assert row["throughput_tok_s"] == 64.0  # 512 tokens in 8 s
    assert row["ttft_s"] == pytest.approx({"p50": 0.12, "p99": 0.48, "mean": 0.15})
    assert row["itl_s"] == pytest.approx({"p50": 0.015, "p99": 0.03, "mean": 0.016})
    text = runner.table([("guidellm", row)])
    assert text.splitlines()[-1].split() == ["guidellm", "4", "16", "64.00", "120.00/480.00", "15.00/30.00"]


def test_guidellm_bodies_are_accepted_by_the_server():
    """What guidellm 0.8 sends on /v1/completions (stream_options with continuous usage, stop:
    null, ignore_eos, max_tokens from output_tokens_count, the extras' temperature)."""
    from outrider.serve.protocol import parse_completion

    body = {"model": "m", "prompt": "w5 w6", "max_tokens": 8, "stop": None, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}, "temperature": 0}
    parsed = parse_completion(body, 96)
    assert parsed.ignore_eos and parsed.include_usage and parsed.continuous_usage and parsed.max_tokens == 8
