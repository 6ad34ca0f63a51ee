"""scripts/load_test.py's options for fair A/B runs (issue 42, items 6 and 7): --repeats pooled per
level, the server's CPU time per phase, the prefix cache off unless --prefix-cache, and --config passed to the server."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from outrider.bench.serve_run import LoadPlan, goals, server_cpu_s
from outrider.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent


def load_script():
    spec = importlib.util.spec_from_file_location("load_test_options", ROOT / "scripts" / "load_test.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def phase(c, mode, tokens, wall, cpu):
    return {"kind": "closed", "concurrency": c, "rate": None, "mode": mode, "ok": 1, "output_tokens": tokens,
            "wall_s": wall, "server_cpu_s": cpu, "throughput_tok_s": tokens / wall, "errors": 0, "lost": 0,
            "metrics": {"agree": True}}


def test_repeated_levels_pool_tokens_over_seconds_by_wall_and_by_cpu():
    phases = [phase(16, "off", 100, 10.0, 20.0), phase(16, "on", 100, 12.0, 19.0),
              phase(16, "on", 300, 10.0, 21.0), phase(16, "off", 100, 10.0, 20.0)]
    g = goals(phases)
    assert g["spec_on_over_off_by_concurrency"][16] == pytest.approx((400 / 22) / (200 / 20))
    assert g["spec_on_over_off_by_concurrency_cpu"][16] == pytest.approx((400 / 40) / (200 / 40))
    text = load_script().goals_text({"goals": g})
    assert "spec on / off at c=16: 1.82x output tokens/s, 2.00x per server CPU second" in text


def test_the_server_flags_and_repeats_reach_the_plan():
    plan, _ = load_script().parse_args(["--quick", "--no-prefix-cache", "--config", "gemm_prefill=off",
                                        "--repeats", "3"])
    assert plan.server_args == ("--no-prefix-cache", "--config", "gemm_prefill=off") and plan.repeats == 3
    # the cache is off unless asked for: the on and off phases send the same prompts
    assert load_script().parse_args(["--quick", "--prefix-cache"])[0].server_args == ()
    plan, _ = load_script().parse_args(["--quick"])
    assert plan.server_args == ("--no-prefix-cache",) and plan.repeats == 1
    with pytest.raises(ConfigError, match="--repeats must be a positive integer"):
        LoadPlan(repeats=0).check()


def test_server_cpu_seconds_grow_with_work():
    before = server_cpu_s(os.getpid())
    if before is None:
        pytest.skip("no /proc here")
    sum(i * i for i in range(300_000))
    assert server_cpu_s(os.getpid()) > before
    assert server_cpu_s(2 ** 22 + 12345) is None  # no such process
