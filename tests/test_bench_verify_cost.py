"""scripts/bench_verify_cost.py's compute floor: the slices it times are the weights' own rows,
and the floor covers every product of the model (a float model has none it can time)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from outrider.config import kernel_variants_here
from outrider.kernels import native

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_verify_cost.py"
needs_native = pytest.mark.skipif(not native.available(), reason="the native kernel is not built here")


def script():
    spec = importlib.util.spec_from_file_location("bench_verify_cost", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs_native
@pytest.mark.parametrize("dtype", ["q4", "q8_0"] + (["q4-i8"] if native.i8_available() else []))
def test_a_slice_multiplies_as_the_first_rows_of_its_weight(tmp_path, dtype):
    from outrider.weights.loader import load_decoder
    from test_quant_model import make_quantizable

    bench = script()
    model = load_decoder(make_quantizable(tmp_path / "model"), "cpu", dtype)
    weights = bench.native_matrices(model)
    assert len(weights) >= 4 * len(model.layers) + 1  # every layer's products and the head
    for w in {id(w): w for w in weights}.values():
        x = torch.randn(3, w.shape[1])
        n = max(1, w.shape[0] // 2)
        assert torch.equal(native.qmatmul(x, bench.first_rows(w, n)), native.qmatmul(x, w)[:, :n])
    floor = bench.compute_floor(model, ks=(1, 16), calls=3)  # tiny weights: timing noise, no order
    assert set(floor) == {1, 16} and all(0 < t < 1 for t in floor.values())


def test_a_float_model_has_no_floor(tmp_path):
    from outrider.weights.loader import load_decoder
    from test_quant_model import make_quantizable

    bench = script()
    model = load_decoder(make_quantizable(tmp_path / "model"), "cpu", torch.float32)
    assert bench.native_matrices(model) == [] and bench.compute_floor(model) == {}


@pytest.mark.skipif(native.variant() not in ("amx", "avx512-vnni"), reason="no AVX-512 VNNI here")
def test_the_peak_loop_runs_every_multiply_add():
    """Lane l of chain i starts at i and gains 4 * (1 * 2) a round: the sums say every vpdpbusd ran."""
    rounds, threads = 1000, 2
    assert native.library().outrider_i8_peak(rounds, threads) == threads * 16 * (276 + 8 * 24 * rounds)
    assert script().int8_peak(1, rounds=1000) > 0


@pytest.mark.skipif("avx2" not in kernel_variants_here(), reason="no AVX2 here")
def test_the_avx2_peak_loop_runs_every_multiply_add():
    """qmatmul_i8_avx2.c's: 16-bit lane of chain i (8) starts at i and gains 6 x (1 * 2 + 1 * 2) a round,
    the two halves of each 32-bit lane added at the end: the sums say every vpmaddubsw ran."""
    rounds, threads = 1000, 2
    with native.use_variant("avx2"):
        native.i8_avx_vnni(False)  # vpmaddubsw, whatever the CPU has
        try:
            assert native.library().outrider_i8_peak(rounds, threads) == threads * 16 * (28 + 192 * rounds)
            assert script().int8_peak(1, rounds=1000) > 0
            if native.i8_avx_vnni(True):
                # AVX-VNNI's loop: 32-bit lane of sum i (8) starts at i and gains 6 x 4 x (1 * 2) a round
                assert native.library().outrider_i8_peak(rounds, threads) == threads * 8 * (28 + 384 * rounds)
        finally:
            native.i8_avx_vnni(True)  # the default: AVX-VNNI where the CPU has it
