"""The report's time-per-round table (bench/round_cost.py) from a synthetic results.json: nodes,
draft and verify ms a round, verify against the baseline's round, a llama-server peer's acceptance."""

from __future__ import annotations

from outrider.bench.round_cost import HEADER, round_cost_table

MODEL = "m"


def _run(method: str, kind: str, summary: dict, prompt_stats=()) -> dict:
    return {"model": MODEL, "workload": "humaneval", "method": method, "label": method, "kind": kind,
            "summary": summary, "prompts": [{"id": f"p{i}", "stats": s} for i, s in enumerate(prompt_stats)]}


def results() -> dict:
    return {"runs": [
        _run("autoregressive", "baseline", {"rounds": 40, "drafted": 0, "draft_s": 0.0, "verify_s": 0.4,
                                            "mean_accepted_length": 1.0}),
        _run("ddtree12", "ours", {"rounds": 20, "drafted": 240, "draft_s": 0.1, "verify_s": 0.5,
                                  "mean_accepted_length": 2.0}),
        _run("server", "peer", {}, [{"draft_n": 30, "draft_n_accepted": 9}, {"draft_n": 10, "draft_n_accepted": 3}]),
        _run("transformers", "peer", {}, [{}]),
    ]}


def test_a_round_is_priced_against_the_baseline_and_a_peer_shows_its_acceptance():
    [(_, text), (_, header, rows)] = round_cost_table(results(), MODEL, "humaneval")
    assert header == HEADER and "humaneval" in text
    by_name = {r[0]: r for r in rows}
    assert set(by_name) == {"autoregressive", "ddtree12", "server"}  # a peer with no drafts is left out
    assert by_name["ddtree12"][1:6] == ["2.00", "12.00", "5.00", "25.00", "2.50"]
    assert by_name["autoregressive"][2:6] == ["0.00", "0.00", "10.00", "1.00"]
    assert by_name["server"][-1] == "12/40 = 0.300" and by_name["server"][2] == "-"


def test_nothing_drafted_is_no_table():
    only_ar = {"runs": results()["runs"][:1]}
    assert round_cost_table(only_ar, MODEL, "humaneval") == []
