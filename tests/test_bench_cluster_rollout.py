"""scripts/bench_cluster_rollout.py's pure parts: the batch's bodies, its figures, the moves counter."""

import importlib.util
import sys
from pathlib import Path

from outrider.bench.serve_load import Record

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def _script():
    sys.path.insert(0, str(SCRIPTS))
    try:
        spec = importlib.util.spec_from_file_location("bench_cluster_rollout", SCRIPTS / "bench_cluster_rollout.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclass looks its module up
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(SCRIPTS))


def test_bodies_sample_each_prompt_with_its_own_seed():
    m = _script()
    t = m.RolloutTarget("http://x", ["a", "b", "c"], False, 64, samples=2, seed=3, plain=True)
    bodies = [t.body(i) for i in range(6)]
    assert [b["prompt"] for b in bodies] == ["a", "a", "b", "b", "c", "c"]
    assert [b["seed"] for b in bodies] == [3000 + i for i in range(6)]
    assert all(b["temperature"] == 1.0 and b["max_tokens"] == 64 and b["speculate"] is False and b["stream"]
               for b in bodies)
    assert "speculate" not in m.RolloutTarget("http://x", ["a"], False, 8).body(0)


def test_figures_and_moves():
    m = _script()
    records = [Record(0, 0, 0.5, "ok", 1.0, 4.0, 10, rounds=5, drafted=4, accepted=2, finish_reason="stop"),
               Record(1, 0, 0.0, "ok", 1.0, 9.0, 64, rounds=64, finish_reason="length"),
               Record(2, 1, 0.0, "error", end=2.0, error="HTTP 500")]
    f = m.figures(records, 64)
    assert (f["makespan_s"], f["ok"], f["errors"], f["lost"], f["output_tokens"]["at_cap"]) == (9.0, 2, 1, 0, 1)
    assert (f["output_tokens"]["min"], f["output_tokens"]["max"], f["speculated_requests"]) == (10, 64, 1)
    text = ('# TYPE outrider:cluster_requests_moved_total counter\n'
            'outrider:cluster_requests_moved_total{reason="tail",replica="0"} 3.0\n'
            'outrider:cluster_requests_moved_total{reason="move",replica="1"} 1.0\n'
            'outrider:cluster_requests_routed_total{reason="bulk",replica="1"} 9.0\n')
    assert m.moved_in(text) == 4.0
