"""Quantized weights: GGUF's blocks, their reference dequantization, and every kernel against it.

Tolerances against `reference_linear` (dequantize, then x @ w.T in float32), elementwise:

- "blockwise" and "native" compute the same float32 products in another summation order. A float32 sum of K
  terms in any order is off by at most about (K + 4) * u32 * sum_k |x_k w_k| (u32 = 2**-24, K - 1
  additions, the product, the weight's own formation): that is the bound allowed.
- the int4 kernels ("int4pack", "int4pair") round x, the scales and the zeros to bfloat16 and the
  result too (quant_linear.py says why). With ub = 2**-8 (bfloat16's unit roundoff) and a_k the sum
  of the absolute terms the kernel adds to form weight k ((code - 8) * scale, zero; for Q8_0 both
  halves), the rounded x changes the sum by at most ub * sum |x_k w_k| <= ub * sum |x_k| a_k, the
  rounded scales and zeros by ub * sum |x_k| a_k, the rounded result by ub * |result|; so the bound
  is 1.05 * ub * (2 * sum_k |x_k| a_k + |reference|) (5% for second-order terms) plus the float32
  term above.

A wrong formula or one wrong block is off by far more (the negative controls check that).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from outrider.kernels import native
from outrider.kernels.blocks import BLOCK, KINDS, QuantBlocks, blocks_from_gguf, dequantize, quantize
from outrider.kernels.quant_linear import QuantLinear, choose_kernel, reference_linear

EXACT = "native" if native.available() else "blockwise"  # the float32 kernel this machine uses by default
needs_native = pytest.mark.skipif(not native.available(), reason=f"native kernel: {native.reason()}")
U32 = 2.0 ** -24  # float32 unit roundoff
UB = 2.0 ** -8  # bfloat16 unit roundoff


def random_blocks(kind: str, out: int, cols: int, seed: int = 0) -> QuantBlocks:
    """Blocks with random codes, scales and mins over the whole range each kind allows."""
    g = torch.Generator().manual_seed(seed)
    nb = cols // BLOCK
    d = (torch.rand(out, nb, generator=g) * 0.1 + 1e-3).half()
    d[torch.rand(out, nb, generator=g) < 0.3] *= -1  # GGUF scales may be negative (Q4_0's are)
    if kind == "q8_0":
        q = torch.randint(-128, 128, (out, cols), generator=g, dtype=torch.int8)
        return QuantBlocks(kind, q, d)
    q = torch.randint(0, 256, (out, cols // 2), generator=g, dtype=torch.uint8)
    m = (torch.randn(out, nb, generator=g) * 0.2).half() if kind == "q4_1" else None
    return QuantBlocks(kind, q, d, m)


def kernel_terms(blocks: QuantBlocks) -> torch.Tensor:
    """[out, in]: the sum of the absolute terms the int4 kernel adds to form each weight."""
    out, cols = blocks.shape
    per_value = lambda t: t.float().repeat_interleave(BLOCK, dim=1)  # noqa: E731  [out, blocks] -> [out, in]
    d = per_value(blocks.d)
    if blocks.kind == "q8_0":
        q = blocks.q.to(torch.int16)
        high, low = (q >> 4).float(), (q & 15).float()
        return (16 * d * high).abs() + ((low - 8) * d).abs() + (8 * d).abs()
    terms = ((blocks.codes().float() - 8) * d).abs()
    return terms if blocks.kind == "q4_0" else terms + (per_value(blocks.m) + 8 * d).abs()


def within_bound(out: torch.Tensor, x: torch.Tensor, blocks: QuantBlocks, kernel: str) -> bool:
    """|out - reference| within the bound the module docstring derives for `kernel`."""
    ref = reference_linear(x, blocks)
    bound = (blocks.shape[1] + 4) * U32 * (x.abs().float() @ dequantize(blocks).abs().T)  # [rows, out]
    if kernel not in ("blockwise", "native"):
        bound = bound + 1.05 * UB * (2 * (x.abs().float() @ kernel_terms(blocks).T) + ref.abs())
    return bool(((out.float() - ref).abs() <= bound + 1e-30).all())


# -- blocks: the same bytes as the gguf package ---------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_quantize_and_dequantize_match_gguf(kind):
    """Our torch quantizer writes gguf's (= ggml's reference) bytes; our dequantize gives the gguf
    reader's float32 values exactly; blocks_from_gguf reads the raw bytes back."""
    import gguf

    rng = np.random.default_rng(1)
    w = rng.standard_normal((20, 128)).astype(np.float32)
    w[0, :32] = 0.0  # an all-zero block (scale 0)
    w[1, :32] = 3.0  # a constant block
    w[2, :32] = -np.abs(w[2, :32]) * 7  # largest magnitude negative (Q4_0 keeps its sign)
    gtype = gguf.GGMLQuantizationType[kind.upper()]
    raw = gguf.quants.quantize(w, gtype)  # uint8 [20, bytes]
    theirs = blocks_from_gguf(raw, kind)
    ours = quantize(torch.from_numpy(w), kind)
    assert torch.equal(ours.q, theirs.q)
    assert torch.equal(ours.d.view(torch.int16), theirs.d.view(torch.int16))
    if kind == "q4_1":
        assert torch.equal(ours.m.view(torch.int16), theirs.m.view(torch.int16))
    assert np.array_equal(dequantize(theirs).numpy(), gguf.quants.dequantize(raw, gtype))


def test_nibble_order_is_gguf_s():
    """Byte j of a Q4 block: value j in the low nibble, value j + 16 in the high nibble."""
    q = torch.arange(16, dtype=torch.uint8).add(16 * 3).view(1, 16)  # low nibbles 0..15, high 3
    codes = QuantBlocks("q4_0", q, torch.ones(1, 1).half()).codes()[0]
    assert codes[:16].tolist() == list(range(16)) and codes[16:].tolist() == [3] * 16


def test_lookup_reads_rows():
    blocks = random_blocks("q4_1", 40, 64)
    ids = torch.tensor([[3, 0, 39], [3, 3, 7]])
    assert torch.equal(blocks.lookup(ids), dequantize(blocks)[ids])


def test_quantize_refuses_ragged_rows():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.zeros(4, 48), "q8_0")


# -- kernels against the reference --------------------------------------------------------------

KERNELS = [("q8_0", "int4pair"), ("q4_0", "int4pack"), ("q4_1", "int4pack"),
           ("q8_0", "blockwise"), ("q4_0", "blockwise"), ("q4_1", "blockwise"),
           pytest.param("q8_0", "native", marks=needs_native), pytest.param("q4_0", "native", marks=needs_native),
           pytest.param("q4_1", "native", marks=needs_native)]
ROW_INDEPENDENT = KERNELS[:3] + KERNELS[6:]  # the int4 kernels and ours


@pytest.mark.parametrize("kind,kernel", KERNELS)
@pytest.mark.parametrize("rows", [1, 3, 8, 17])
@pytest.mark.parametrize("shape", [(48, 64), (160, 576)])
def test_kernel_matches_reference(kind, kernel, rows, shape):
    blocks = random_blocks(kind, *shape, seed=rows)
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(7))
    weight = QuantLinear(blocks, kernel=kernel)
    assert weight.kernel == kernel
    out = weight.linear(x)
    assert out.shape == (rows, shape[0]) and out.dtype == torch.float32
    assert within_bound(out, x, blocks, kernel)


def test_kernel_takes_batched_input_and_bias():
    blocks = random_blocks("q4_1", 32, 64)
    x = torch.randn(2, 5, 64)
    bias = torch.randn(32)
    weight = QuantLinear(blocks)
    out = weight.linear(x, bias)
    assert out.shape == (2, 5, 32) and out.dtype == torch.float32
    assert within_bound((out - bias).view(10, 32), x.view(10, 64), blocks, weight.kernel)


@pytest.mark.parametrize("kind,kernel", KERNELS)
def test_bound_catches_one_wrong_block(kind, kernel):
    """Negative control: the reference with one block's scale changed is far outside the bound."""
    blocks = random_blocks(kind, 48, 64)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(11))  # seeded: the result must not hang on the order tests run in
    d = blocks.d.clone()
    d[5, 1] = d[5, 1] * 3
    wrong = QuantBlocks(blocks.kind, blocks.q, d, blocks.m)
    assert within_bound(QuantLinear(blocks, kernel=kernel).linear(x), x, blocks, kernel)
    assert not within_bound(QuantLinear(wrong, kernel=kernel).linear(x), x, blocks, kernel)


@pytest.mark.parametrize("kind,kernel", ROW_INDEPENDENT)
def test_kernels_are_row_independent(kind, kernel):
    """A row's result does not depend on the other rows of the call, bit for bit: a k-token
    verify forward computes what k one-token steps compute (greedy equality relies on it)."""
    weight = QuantLinear(random_blocks(kind, 64, 128), kernel=kernel)
    x = torch.randn(9, 128)
    full = weight.linear(x)
    for rows in (1, 2, 5):
        assert torch.equal(weight.linear(x[:rows]), full[:rows])


def test_int4_formula_is_code_minus_8_times_scale_plus_zero():
    """What torch's CPU int4 kernel computes, found by experiment: w = (code - 8) * scale + zero."""
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (32, 64), generator=g, dtype=torch.int32)
    scale, zero = torch.rand(64 // 32, 32, generator=g), torch.randn(64 // 32, 32, generator=g)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
    eye = torch.eye(64)
    w = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, packed, 32, torch.stack((scale, zero), -1)).T
    expected = (codes - 8) * scale.repeat_interleave(32, 0).T + zero.repeat_interleave(32, 0).T
    torch.testing.assert_close(w, expected, rtol=0, atol=1e-6)


def test_choose_kernel():
    assert choose_kernel(random_blocks("q4_1", 32, 64)) == EXACT  # exact unless asked
    assert choose_kernel(random_blocks("q4_1", 32, 64), dtype=torch.bfloat16) == "blockwise"  # native: float32 only
    assert choose_kernel(random_blocks("q4_0", 32, 64), fast=True) == "int4pack"
    assert choose_kernel(random_blocks("q4_1", 32, 64), fast=True) == "int4pack"
    assert choose_kernel(random_blocks("q8_0", 32, 64), fast=True) == "int4pair"
    assert choose_kernel(random_blocks("q4_1", 40, 64), fast=True) == EXACT  # int4 needs out % 16 == 0
    assert QuantLinear(random_blocks("q8_0", 32, 64)).kernel == "blockwise"
    with pytest.raises(ValueError, match=f"use {EXACT}"):
        QuantLinear(random_blocks("q4_1", 40, 64), kernel="int4pack")
    with pytest.raises(ValueError, match="use int4pack"):
        QuantLinear(random_blocks("q4_1", 32, 64), kernel="int4pair")


@pytest.mark.parametrize("kind,kernel,limit", [
    ("q4_1", "int4pack", 0.8), ("q4_0", "int4pack", 0.8), ("q8_0", "int4pair", 1.55),
    ("q4_1", "blockwise", 1.3), ("q8_0", "blockwise", 1.15)])
def test_quantized_memory_is_small(kind, kernel, limit):
    """Bytes a forward reads per weight (float32: 4): Q4 in the int4 kernel about 0.56, Q8_0 as
    two 4-bit halves about 1.5 (their bfloat16 scales and zeros), the blockwise kernel's codes one
    a byte plus a float32 scale (and offset) per 32."""
    weight = QuantLinear(random_blocks(kind, 64, 576), kernel=kernel)
    assert weight.nbytes() <= limit * 64 * 576
