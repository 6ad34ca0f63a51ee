"""Serving against llama-server (bench/serve_peer.py, scripts/load_test.py --against): a real
`outrider serve` on a tiny model and the llama-server stand-in (fixtures/fake_llama_server.py,
streamed OpenAI-style completions), the same closed-loop levels on both in alternating order,
the stand-in's slots and context from the largest concurrency, its drafts read from its timings,
the ratios; and what the comparison refuses in one line."""

from __future__ import annotations

import json

import pytest
from test_bench_llama_server import fake, flag  # noqa: F401 (the fixture)
from test_load_test import load_script

from outrider.bench import serve_peer
from outrider.errors import ConfigError

ROOT = serve_peer.Path(__file__).resolve().parent.parent


def test_both_servers_get_the_same_levels_and_prompts(fake, tiny_folders, tmp_path, monkeypatch, capsys,  # noqa: F811
                                                      runtime):
    runtime(bench_fixtures=str(ROOT / "tests" / "fixtures"))
    monkeypatch.setattr(serve_peer, "model_folder", lambda plan: fake["target"])  # the tiny model has no GGUF
    out = tmp_path / "out"
    argv = ["--quick", "--against", "llama-server:ngram-mod", "--model", str(tiny_folders["llama"]),
            "--drafter", "ngram", "--controller", "fixed:3", "--concurrency", "1,2", "--requests", "2",
            "--phase-time", "0.01", "--min-requests", "2", "--max-tokens", "5", "--out", str(out)]
    assert load_script().main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    phases = results["phases"]
    # alternating order level by level; the same fresh prompts on both at a level
    assert [(p["concurrency"], p["server"]) for p in phases] == [
        (1, "outrider"), (1, "llama-server"), (2, "llama-server"), (2, "outrider")]
    assert [[r["prompt"] for r in p["records"]] for p in phases] == [[1, 2], [1, 2], [3, 4], [3, 4]]
    for p in phases:
        assert p["ok"] == p["requests"] == 2 and p["errors"] == p["lost"] == 0 and p["output_tokens"] > 0
    ours, theirs = phases[0], phases[1]
    assert sum(r["drafted"] for r in ours["records"]) > 0  # speculation on in ours
    assert theirs["output_tokens"] == 10 and theirs["acceptance"] == pytest.approx(0.4)  # 2 of 5 from its timings
    (args,) = fake["starts"]()
    assert flag(args, "--spec-type") == "ngram-mod" and flag(args, "-np") == "2"
    assert flag(args, "-c") == str(2 * serve_peer.PER_SLOT) and flag(args, "-t") == flag(args, "-tb") == "1"
    assert "--threads" in results["server_command"] and results["plan"]["threads"] == 1
    r = results["ratios"]["1"]
    assert r["throughput"] == pytest.approx(ours["throughput_tok_s"] / theirs["throughput_tok_s"])
    assert r["met"] == (r["throughput"] >= 1.5) and r["ttft_p50"] > 0
    text = capsys.readouterr().out
    assert "| 1 | llama-server | 2 / 2 |" in text and "throughput ours / llama-server at 2 clients" in text


def test_what_it_cannot_run_is_one_line(fake, tmp_path):  # noqa: F811
    with pytest.raises(ConfigError, match="^--against llama-server:draft-simple: draft-simple needs a draft"):
        serve_peer.start_llama_server("llama-server:draft-simple", fake["target"], 1, 1)
    with pytest.raises(ConfigError, match="^--against llama-server: no original GGUF at"):
        serve_peer.start_llama_server("llama-server", tmp_path, 1, 1)
    with pytest.raises(ConfigError, match="spec type 'bogus' is not one"):
        serve_peer.start_llama_server("llama-server:bogus", fake["target"], 1, 1)
    assert serve_peer.ratios([{"server": "outrider", "concurrency": 1}]) == {}  # one server alone: no ratio
