"""scripts/bench_treewy.py's core at tiny shapes: the bytes it reads off DeltaState's held rows
match the stash's formula (x in the model dtype, k in float32; u, gamma in float64), the snapshots' bytes
are the [HV, dk, dv] state per node, and TreeWY's outputs and accepted state equal the snapshots'.
No timing is checked."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_treewy.py"


def script():
    spec = importlib.util.spec_from_file_location("bench_treewy", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_bytes_and_audit_at_tiny_shapes():
    bench = script()
    s = bench.Shapes(HV=2, HK=2, dk=8, dv=8, K=4, delta_layers=3)
    row = bench.measure_tree(s, "static:2,1", [2, 1], threads=(1,), repeats=1)
    assert bench.tree_parents([2, 1]) == [-1, 0, 0, 1, 2] and row["nodes"] == 5
    held, snap = row["held"], row["snapshot"]
    C = 2 * s.HK * s.dk + s.HV * s.dv
    # k in float32 (exact: it was float32 before the state's arithmetic), u and gamma float64, x float32
    assert held["logical"] == s.HV * (4 * s.dk + 8 * s.dv + 8) + C * 4
    assert held["pinned"] == held["logical"]  # x is copied: no view keeps the whole in_proj output
    assert snap["state"]["float64 (ours)"] == s.HV * s.dk * s.dv * 8
    assert snap["conv_window"]["float32"] == (s.K - 1) * C * 4
    pred = bench.predicted(s, 8, 4, 4)
    stash_state = sum(held["parts"][p]["bytes"] for p in ("k", "u", "gamma"))
    # against the algebra's one-dtype ratio, k's half width only helps
    assert snap["state"]["float64 (ours)"] / stash_state > pred["state_only"]
    assert pred["state_only"] == s.dk * s.dv / (s.dk + s.dv + 1)
    assert row["max_abs_diff_out"] < 1e-12 and row["max_abs_diff_state"] < 1e-12
    assert set(row["times_ms"]["1"]) == {"tree_step", "snapshot_tree", "fold"}
    whole = bench.whole_model(s, held, snap)
    assert abs(whole["snapshot float64 state"]["MiB_per_14_nodes"] * (1 << 20)
               - 3 * 14 * s.HV * s.dk * s.dv * 8) < 1e-6
