"""qmatmul_fill.c, the kernel for many rows (a prompt's prefill): the very bits of the row kernel
(qmatmul.c) for every element, on every variant this machine executes, every weight kind the row
kernel takes (float16, float32 and a K-quant's factored scales), any number of rows, any tiling
of the weight rows (tails of a register tile, of a thread's decoded tile) and 1 or 2 threads. So a
prompt prefilled whole, in chunks, or row by row gives the same K/V, and which path a product
takes is a matter of speed only."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from outrider.kernels import native
from outrider.kernels.blocks import dequantize
from kernel_variants import ALL, variant  # noqa: F401  (variant: the fixture)
from test_quant import random_blocks
from outrider.weights.quant_convert import gguf_blocks
from test_quant_convert import random_raw

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernel: {native.reason()}")


def weights():
    """(name, NativeWeight) for every kind and scale form the kernels take."""
    for kind in ("q8_0", "q4_0", "q4_1"):
        # 70 and 71 x 576: several decoded tiles a thread; 13-15 x 1536: a tile of a few rows over
        # a long row; together every tail of a register tile's weight rows (AVX2: 3, AVX-512: 6)
        for out, cols in ((70, 576), (71, 576), (13, 1536), (14, 1536), (15, 1536)):
            blocks = random_blocks(kind, out, cols, seed=out)
            yield f"{kind} {out}x{cols}", native.NativeWeight.of(blocks)
        wide = replace(blocks, d=blocks.d.float(), m=None if blocks.m is None else blocks.m.float())
        yield f"{kind} float32 scales", native.NativeWeight.of(wide)
    for type_name in ("Q4_K", "Q6_K"):  # q4_1 and q8_16 with factored scales, and q8_16 widened
        blocks = gguf_blocks(random_raw(type_name, 40, 512, seed=5), type_name)
        yield f"{type_name} factored", native.NativeWeight.of(blocks)
        yield f"{type_name} widened", native.NativeWeight.of(replace(blocks, factored=None))


@pytest.mark.parametrize("variant", ALL, indirect=True)
def test_the_fill_kernel_gives_the_row_kernels_bits(variant):
    threads = torch.get_num_threads()
    g = torch.Generator().manual_seed(0)
    try:
        for name, weight in weights():
            in_features = weight.shape[1]
            x = torch.randn(41, in_features, generator=g)
            torch.set_num_threads(1)
            rows = native.qmatmul(x, weight, path="rows")
            for count in (3, 4, 7, 10):  # the row kernel's own groups (AVX2: 3s, one 4 for a remainder of 1)
                assert torch.equal(native.qmatmul(x[:count], weight, path="rows"), rows[:count]), (name, count)
            for count in (1, 2, 3, 5, 7, 17, 41):  # register-tile tails of every size (AVX2: 4 rows, AVX-512: 4)
                for threads_now in (1, 2):
                    torch.set_num_threads(threads_now)
                    filled = native.qmatmul(x[:count], weight, path="fill")
                    assert torch.equal(filled, rows[:count]), (name, count, threads_now)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("variant", ALL, indirect=True)
def test_the_fill_kernel_computes_the_product(variant):
    """Not only equal to the row kernel: x @ W.T within float32 rounding of the float64 product."""
    blocks = random_blocks("q4_1", 70, 576, seed=2)
    x = torch.randn(33, 576, generator=torch.Generator().manual_seed(3))
    want = x.double() @ dequantize(blocks).double().T
    got = native.qmatmul(x, native.NativeWeight.of(blocks), path="fill")
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()


def test_auto_takes_the_fill_kernel_from_its_row_count():
    """The row count is the build's, per kind, changed only within fill_rows_at (A/B timing), and put back."""
    built, q8 = native.fill_rows(), native.fill_rows("q8_0")
    assert 1 <= built <= q8 == native.fill_rows("q8_16")  # a Q8 block is cheap to decode: later
    with native.fill_rows_at(1 << 30):
        assert native.fill_rows() == native.fill_rows("q8_0") == 1 << 30
    assert (native.fill_rows(), native.fill_rows("q8_0")) == (built, q8)
    weight = native.NativeWeight.of(random_blocks("q4_0", 20, 64, seed=1))
    with pytest.raises(ValueError, match="path must be one of auto, rows, fill"):
        native.qmatmul(torch.zeros(2, 64), weight, path="gemm")
