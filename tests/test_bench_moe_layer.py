"""scripts/bench_moe_layer.py's --shape mode (issue 41 item 5: a verify's cost at a real MoE's shapes),
run at the tiny shape: the streams, the experts' file, and the table's figures."""

import argparse
import importlib.util
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_moe_layer.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_moe_layer", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_streams_independent_and_correlated(bench):
    x0 = bench.stream(200, 32, 0.0, 5)  # [200, 32]
    assert torch.equal(x0, torch.randn(200, 32, generator=torch.Generator().manual_seed(5)))
    x9 = bench.stream(200, 32, 0.9, 5)
    corr = torch.nn.functional.cosine_similarity(x9[1:], x9[:-1]).mean()
    assert 0.8 < corr < 0.97  # rho 0.9 between neighbours, unit variance kept
    assert abs(x9.var() - 1) < 0.2


def test_experts_file_is_what_the_store_reads(bench, tmp_path):
    from outrider.models.expert_store import ExpertStore
    resident = bench.write_experts(tmp_path / "e.safetensors", 16, 8, 3, 0)
    store = ExpertStore(tmp_path / "e.safetensors", 1, 3, 1, dtype=torch.float32)
    for e in range(3):
        gate_up, down = store.get(0, e)
        assert gate_up.shape == (16, 16) and down.shape == (16, 8)
        assert torch.equal(gate_up, resident[e][0]) and torch.equal(down, resident[e][1])
    assert store.stats.bytes_read == 3 * 3 * 16 * 8 * 2  # bfloat16
    store.close()


def test_tiny_table(bench, capsys, tmp_path):
    args = argparse.Namespace(shape="tiny", experts=None, store="mmap", rho=0.9, dir=str(tmp_path), rounds=2, seed=0)
    torch.set_num_threads(1)
    bench.verify_cost(args)
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| random") or
            line.startswith("| rho")]
    assert len(rows) == 2 * len(bench.KS)
    for row in rows:
        k, distinct = int(row[1]), float(row[2])
        assert distinct <= min(8, 2 * k) and float(row[3]) >= 0  # at most K * top_k of 8
        if k == 1:
            assert distinct == 2 and row[-2] == "1.00" and row[-1] == "1.00 |"
    random16, correlated16 = float(rows[4][2]), float(rows[9][2])
    assert correlated16 < random16  # neighbours route alike: fewer experts per verify
