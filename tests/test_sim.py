"""The simulator's event logic on workloads whose answer is computed by hand, and its figures
against a recorded real run (tests/fixtures/sim_load_run.json, measured with the profile in
tests/fixtures/sim_profile.json on the same machine)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from outrider.cluster.length import LengthModel
from outrider.cluster.policies.outlets import OUTLETS
from outrider.cluster.policies.tailsieve import TailSieve
from outrider.cluster.policy import RequestInfo
from outrider.cluster.sim.baseline import LeastLoadFCFS, load_policy
from outrider.cluster.sim.costs import CostModel, load_profile
from outrider.cluster.sim.engine import simulate
from outrider.cluster.sim.report import summarize
from outrider.cluster.sim.synth import make
from outrider.cluster.sim.workload import ReplicaSpec, SimRequest, Workload, from_load_run
from outrider.errors import ConfigError

FIXTURES = Path(__file__).parent / "fixtures"
FLAT = CostModel((1,), (1,), ((0.1,),))  # every round 0.1 s whatever the batch; no prefill cost


def sim_req(id, out, prompt=1, arrived=0.0, tau=1.0, **kw) -> SimRequest:
    return SimRequest(RequestInfo(id, prompt, 1000, arrived, **{k: v for k, v in kw.items() if k in ("group", "session")}),
                      out, tau, 1.0 + 2 * (tau > 1))


def latencies(workload, policy, costs=FLAT, replicas=1) -> dict[str, float]:
    result = simulate(workload, policy, costs, replicas)
    return {j.id: round(j.finished - j.arrived, 9) for j in result.jobs}


def test_one_slot_fcfs_gives_exact_latencies():
    w = Workload("w", [sim_req("a", 2), sim_req("b", 3), sim_req("c", 1)], replica=ReplicaSpec(max_running=1))
    assert latencies(w, LeastLoadFCFS()) == {"a": 0.2, "b": 0.5, "c": 0.6}


def test_a_batch_shares_each_round():
    w = Workload("w", [sim_req("a", 2), sim_req("b", 3), sim_req("c", 1)], replica=ReplicaSpec(max_running=3))
    assert latencies(w, LeastLoadFCFS()) == {"a": 0.2, "b": 0.3, "c": 0.1}


def test_prefill_and_speculation_cost_what_the_profile_says():
    costs = CostModel((1, 2), (1, 3), ((0.1, 0.2), (0.1, 0.2)), (10,), (0.5,))
    # 11-token prompt: 10 prefilled (0.5 s) in the first step, which also runs the first round
    # (3 wide: 0.2 s); tau 2 commits 4 tokens in 2 rounds: 0.7 + 0.2
    w = Workload("w", [sim_req("a", 4, prompt=11, tau=2.0)], replica=ReplicaSpec(max_running=1))
    assert latencies(w, LeastLoadFCFS(), costs) == {"a": pytest.approx(0.9)}
    assert latencies(w, LeastLoadFCFS(speculate=False), costs) == {"a": pytest.approx(0.6 + 3 * 0.1)}


def test_arrivals_wait_for_the_step_in_progress():
    w = Workload("w", [sim_req("a", 3), sim_req("b", 1, arrived=0.05)], replica=ReplicaSpec(max_running=2))
    assert latencies(w, LeastLoadFCFS()) == {"a": 0.3, "b": pytest.approx(0.15)}  # b joins at 0.1, ends 0.2


def test_closed_loop_sends_the_next_request_when_one_ends():
    w = Workload("w", [sim_req("a", 2), sim_req("b", 1), sim_req("c", 1)], clients=1)
    result = simulate(w, LeastLoadFCFS(), FLAT, 1)
    assert [(j.id, round(j.arrived, 9), round(j.finished, 9)) for j in result.jobs] == [
        ("a", 0.0, 0.2), ("b", 0.2, 0.3), ("c", 0.3, 0.4)]


def test_a_request_that_can_never_fit_is_refused_in_one_line():
    w = Workload("w", [sim_req("a", 2, prompt=900)], replica=ReplicaSpec(kv_rows_total=1000))
    with pytest.raises(ConfigError, match="reserves 1901 K/V rows but replica 0 holds 1000"):
        simulate(w, LeastLoadFCFS(speculate=False), FLAT, 1)


def test_least_load_spreads_over_replicas():
    w = Workload("w", [sim_req(x, 2) for x in "abcd"], replica=ReplicaSpec(max_running=1))
    assert latencies(w, LeastLoadFCFS(), replicas=2) == {"a": 0.2, "b": 0.2, "c": 0.4, "d": 0.4}


def test_outlets_runs_the_short_job_first_and_lowers_the_mean():
    # one slot busy with "x" until 0.1; then "long" (arrived first) and "short" wait
    reqs = [sim_req("x", 1), sim_req("long", 5, prompt=50, arrived=0.01), sim_req("short", 1, prompt=2, arrived=0.02)]
    w = Workload("w", reqs, replica=ReplicaSpec(max_running=1))
    fcfs = latencies(w, LeastLoadFCFS())
    sjf = latencies(w, OUTLETS(model=LengthModel(("a",), (0.0, 1.0, 0.0, 0.0, 0.0)), aging=0.0, history=0))
    assert fcfs["short"] == pytest.approx(0.7 - 0.02) and sjf["short"] == pytest.approx(0.2 - 0.02)
    assert sum(sjf.values()) < sum(fcfs.values())


def test_tailsieve_moves_the_tail_and_shortens_the_makespan():
    # replica 0 bulk (one plain slot at a time ... of 4), replica 1 low latency (speculating, tau 3)
    reqs = [sim_req(f"s{i}", n, tau=3.0, group="g") for i, n in enumerate((2, 2, 30, 30))]
    spec = ReplicaSpec(max_running=4, speculative=False, low_latency=1, low_latency_max_running=2)
    w = Workload("w", reqs, replica=spec, kind="rollout")
    base = simulate(w, LeastLoadFCFS(), FLAT, 2)
    tail = simulate(w, TailSieve(tail=0.5), FLAT, 2)
    assert {j.id for j in tail.jobs if j.moves} == {"s2", "s3"}
    assert summarize(tail)["makespan_s"] < summarize(base)["makespan_s"]


def test_synthetic_workloads_are_seeded_and_refuse_bad_specs():
    records = [{"workload": "w", "prompt": p, "prompt_tokens": 20 + p, "max_tokens": 64, "output_tokens": 10 + 7 * p,
                "tau": 1.5, "width": 5.0} for p in range(5)]
    costs = CostModel((1, 16), (1, 8), ((0.01, 0.02), (0.05, 0.1)))
    a, b = make("chat:per_replica=5", records, 2, costs), make("chat:per_replica=5", records, 2, costs)
    assert [r.info for r in a.requests] == [r.info for r in b.requests] and len(a.requests) == 10
    roll = make("rollout:groups=1,samples=4", records, 8, costs)
    assert len(roll.requests) == 32 and roll.replica.low_latency == 1
    for bad in ("nope", "chat:zzz=1", "chat:load=high"):
        with pytest.raises(ConfigError):
            make(bad, records, 1, costs)


def test_bad_profiles_and_runs_are_refused_in_one_line(tmp_path):
    (tmp_path / "p.json").write_text('{"batches": [1, 2], "widths": [1], "seconds": [[0.1]]}')
    (tmp_path / "r.json").write_text('{"phases": 3}')
    for call in (lambda: load_profile(tmp_path / "p.json"), lambda: load_profile(tmp_path / "none.json"),
                 lambda: from_load_run(tmp_path / "r.json"), lambda: load_policy("fcfs:x=1"),
                 lambda: load_policy("nope")):
        with pytest.raises(ConfigError) as err:
            call()
        assert "\n" not in str(err.value)


# Phases of the recording the simulator misses by more than 15% (docs/scheduling.md, Validation):
# at 4 clients it was 1.35-1.39x as fast as the real server, p50 latency 0.70-0.78x.
KNOWN_MISSES = {"closed c=4 spec off": 0.45, "closed c=4 spec on": 0.45}


def test_simulated_replay_of_a_recorded_run_is_within_15_percent():
    """Each phase of a real `outrider serve` load test (one replica), replayed with the cost
    profile measured on the same machine minutes later: throughput and p50 latency within 15%
    (the two known misses within their own recorded bound, so a change shows)."""
    costs = load_profile(FIXTURES / "sim_profile.json")
    phases = from_load_run(FIXTURES / "sim_load_run.json")
    assert len(phases) == 8
    for workload in phases:
        s = summarize(simulate(workload, LeastLoadFCFS(), costs, 1), start=0.0)
        real, rel = workload.measured, KNOWN_MISSES.get(workload.name, 0.15)
        assert s["throughput_tok_s"] == pytest.approx(real["throughput_tok_s"], rel=rel), workload.name
        assert s["e2e_s"]["p50"] == pytest.approx(real["e2e_p50_s"], rel=rel), workload.name
    assert json.loads((FIXTURES / "sim_load_run.json").read_text())["plan"]["threads"] == 1
