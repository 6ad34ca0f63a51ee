"""matmul_amx.c: a prefill's products on the AMX tile unit with exact products and float32 sums. Its
results are float32 dot products of the reference's values (bounded here against float64, as
tightly as a float32 GEMM's), each row's independent of the other rows and the threads, and it
is taken only by forwards that fill the cache, from TILE_ROWS rows; where the CPU has no AMX the
tests below that need it are skipped (the GEMM path keeps its own tests in test_quant_native.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from outrider.kernels import dispatch, native, quant_linear
from outrider.kernels.blocks import QuantBlocks, dequantize, quantize
from outrider.kernels.quant_linear import QuantLinear
from cpu_profiles import INTEL_AMX

needs_tiles = pytest.mark.skipif(not native.amx_available(), reason="no AMX tile unit here (or not granted)")

KINDS = ["q8_0", "q4_0", "q4_1", "q4_1 float32 scales", "q8_0 float32 scales", "q8_16"]


def weight_of(kind: str, rows: int, cols: int, seed: int):
    base = kind.split()[0]
    if base == "q8_16":  # a Q6_K kept exactly (weights/quant_convert.py): codes -32..31, a float32 scale per 16 values
        g = torch.Generator().manual_seed(seed)
        codes = torch.randint(-32, 32, (rows, cols), generator=g, dtype=torch.int8)
        return QuantBlocks("q8_16", codes, torch.rand(rows, cols // 16, generator=g) * 1e-3)
    blocks = quantize(torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.05, base)
    if "float32" in kind:  # as a K-quant's re-expressed scales are kept
        blocks = replace(blocks, d=blocks.d.float(), m=None if blocks.m is None else blocks.m.float())
    return blocks


@needs_tiles
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(1, 64, 16), (37, 160, 48), (70, 576, 960)])
def test_products_are_float32_dot_products_of_the_references_values(kind, shape):
    """Within a float32 GEMM's error of the float64 product of x and quant.dequantize's values
    (K = 160: a chunk of 128 values and a rest; N = 48: a last pair with one block of 16)."""
    M, K, N = shape
    blocks = weight_of(kind, N, K, seed=M)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(K))
    y = native.amx_matmul(x, native.NativeWeight.of(blocks))
    w = dequantize(blocks)
    exact = x.double() @ w.double().T
    scale = x.double().abs() @ w.double().abs().T  # [M, N]: what a dot product's rounding scales with
    gemm = (x @ w.T).double()
    assert y is not None and y.shape == (M, N)
    bound = max(2 * ((gemm - exact).abs() / scale).max().item(), 2 ** -22)
    assert ((y.double() - exact).abs() / scale).max().item() <= bound


@needs_tiles
@pytest.mark.parametrize("kind", KINDS)
def test_a_rows_result_does_not_depend_on_the_rows_beside_it_or_the_threads(kind):
    blocks = weight_of(kind, 96, 288, seed=3)
    weight = native.NativeWeight.of(blocks)
    x = torch.randn(50, 288, generator=torch.Generator().manual_seed(4))
    full = native.amx_matmul(x, weight)
    assert torch.equal(native.amx_matmul(x[17:41], weight), full[17:41])
    assert torch.equal(native.amx_matmul(x[5:6], weight), full[5:6])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(native.amx_matmul(x, weight), full)
    finally:
        torch.set_num_threads(threads)


@needs_tiles
@pytest.mark.parametrize("kind", ["q4_1", "q8_16"])
def test_the_lossy_one_part_form_rounds_only_x(kind):
    """lossy_bf16 (a drafter's prefill): x rounded to bfloat16, the codes exact, float32 sums: within
    float32 rounding of the float64 product of the rounded x and the reference's values."""
    blocks = weight_of(kind, 64, 256, seed=9)
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(10))
    y = native.amx_matmul(x, native.NativeWeight.of(blocks), lossy_bf16=True)
    w = dequantize(blocks).double()
    rounded = x.to(torch.bfloat16).double() @ w.T
    scale = x.double().abs() @ w.abs().T
    assert ((y.double() - rounded).abs() / scale).max().item() <= 2 ** -20
    assert ((y.double() - x.double() @ w.T).abs() / scale).max().item() > 2 ** -12  # it did round x


@needs_tiles
def test_weights_it_does_not_take_are_left_to_the_caller():
    """Outputs not a multiple of 16: the caller's GEMM."""
    x = torch.randn(32, 64)
    assert native.amx_matmul(x, native.NativeWeight.of(quantize(torch.randn(40, 64), "q4_0"))) is None


@needs_tiles
def test_rows_past_fill_rows_are_split_into_calls(monkeypatch):
    blocks = weight_of("q4_1", 32, 64, seed=5)
    weight = native.NativeWeight.of(blocks)
    x = torch.randn(45, 64, generator=torch.Generator().manual_seed(6))
    whole = native.amx_matmul(x, weight)
    monkeypatch.setattr(native, "AMX_ROWS", 16)
    assert torch.equal(native.amx_matmul(x, weight), whole)


@needs_tiles
def test_a_filling_forward_takes_it_from_tile_rows(monkeypatch, runtime):
    """Within quant_linear.filling(): TILE_ROWS rows or more go to matmul_amx.c (a drafter's prefill: its
    one-part form), fewer to the kernel;
    outside a filling forward (decode, verify) always the kernel; OUTRIDER_TILE_PREFILL=0 (read
    once) keeps the GEMM."""
    runtime(lossy_bf16_prefill=False)
    runtime(amx_prefill=None)
    blocks = weight_of("q4_1", 64, 576, seed=7)
    weight = QuantLinear(blocks, kernel="native")
    rows = dispatch.TILE_ROWS
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(8))
    tiles = native.amx_matmul(x, native.NativeWeight.of(blocks))
    with quant_linear.filling():
        assert torch.equal(weight.linear(x), tiles)
        assert torch.equal(weight.linear(x[: rows - 1]), native.qmatmul(x[: rows - 1], blocks))
    with quant_linear.filling(bf16=True):  # a drafter's prefill: one bfloat16 part
        assert torch.equal(weight.linear(x), native.amx_matmul(x, native.NativeWeight.of(blocks), lossy_bf16=True))
    assert torch.equal(weight.linear(x), native.qmatmul(x, blocks))
    assert not torch.equal(tiles, native.qmatmul(x, blocks))  # another summation: the tiles really ran
    runtime(amx_prefill="0")
    with quant_linear.filling():
        assert torch.equal(weight.linear(x), native.qmatmul(x, blocks))  # below BULK_ROWS: the kernel


def test_without_the_tile_unit_it_says_none(monkeypatch):
    """Where matmul_amx.c cannot run (no AMX, a build without it), amx_matmul gives None and the
    filling path takes the next (the row kernel, at these rows), even where the rule says tiles:
    runs on every machine."""
    monkeypatch.setattr(native, "amx_available", lambda: False)
    blocks = quantize(torch.randn(32, 64), "q4_0")
    assert native.amx_matmul(torch.randn(32, 64), native.NativeWeight.of(blocks)) is None
    x = torch.randn(dispatch.TILE_ROWS, 64)
    with dispatch.pretending(INTEL_AMX):
        assert dispatch.plan().product(dispatch.TILE_ROWS) is dispatch.Product.TILES
        with quant_linear.filling():
            assert torch.equal(QuantLinear(blocks, kernel="native").linear(x), native.qmatmul(x, blocks))
