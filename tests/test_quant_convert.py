"""quant_convert: Q5_0, Q4_K and Q6_K blocks kept exactly in our block forms. Every value equals
`gguf.quants.dequantize`'s (as numbers: a zero may differ in sign), on random blocks (any bytes
are valid blocks once the float16 scales are finite) and on the packaged Qwen GGUFs."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from outrider.kernels import native
from outrider.kernels.blocks import dequantize
from outrider.weights.quant_convert import CONVERTED, gguf_blocks
from outrider.kernels.quant_linear import QuantLinear, reference_linear

SIZES = {"Q5_0": (32, 22, [0]), "Q4_K": (256, 144, [0, 2]), "Q6_K": (256, 210, [208])}  # values, bytes, half offsets


def random_raw(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random bytes as blocks of `type_name`, its float16 scales set to finite random values."""
    values, size, halves = SIZES[type_name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // values, size), dtype=np.uint8)
    for at in halves:
        scale = (rng.standard_normal((rows, cols // values)) * 0.01).astype(np.float16)
        scale[0, 0] = 0  # a zero scale too
        raw[..., at:at + 2] = scale[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


def reference(raw: np.ndarray, type_name: str) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    return np.asarray(gguf_dequantize(raw, GGMLQuantizationType[type_name]), dtype=np.float32)


@pytest.mark.parametrize("type_name", CONVERTED)
def test_values_equal_ggufs(type_name):
    raw = random_raw(type_name, 6, 512)
    blocks = gguf_blocks(raw, type_name, "t")
    assert blocks.shape == (6, 512)
    assert np.array_equal(dequantize(blocks).numpy(), reference(raw, type_name))


@pytest.mark.parametrize("type_name", CONVERTED)
def test_one_flipped_bit_is_seen(type_name):
    """Negative control: the comparison above catches a single changed code bit."""
    raw = random_raw(type_name, 2, 256, seed=1)
    wrong = raw.copy()
    wrong[1, -3] ^= 1  # a code byte (the last bytes of every kind here are codes or qh bits)
    if type_name == "Q6_K":
        wrong[1, 5] ^= 1  # Q6_K ends with its scale: flip an ql byte instead
    assert not np.array_equal(dequantize(gguf_blocks(wrong, type_name)).numpy(), reference(raw, type_name))


@pytest.mark.parametrize("type_name", CONVERTED)
@pytest.mark.parametrize("kernel", ["blockwise", pytest.param("native", marks=pytest.mark.skipif(
    not native.available(), reason="native kernel unavailable"))])
def test_kernels_compute_the_converted_blocks(type_name, kernel):
    blocks = gguf_blocks(random_raw(type_name, 40, 512, seed=2), type_name)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(3))
    ref = reference_linear(x, blocks)
    got = QuantLinear(blocks, kernel=kernel).linear(x)
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()
    if kernel == "native":  # each row the same bits alone (the float GEMM makes no such promise)
        for rows in (1, 3):
            assert torch.equal(QuantLinear(blocks, kernel=kernel).linear(x[:rows]), got[:rows])


def test_ragged_row_is_refused():
    from outrider.errors import ModelError

    with pytest.raises(ModelError, match="whole blocks"):
        gguf_blocks(np.zeros((2, 100), dtype=np.uint8), "Q4_K", "t")


@pytest.mark.model
@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"])
def test_packaged_qwen_tensors_equal_ggufs(name):
    """One tensor of every kind in the packaged files (skipped where the model is not pulled)."""
    from outrider.catalog.pull import is_present
    from outrider.catalog.packages import model_path
    from outrider.weights.gguf_index import GGUFIndex

    if not is_present(name):
        pytest.skip(f"{name} is not pulled")
    index = GGUFIndex.open(model_path(name) / "original.gguf")
    seen = set()
    for tensor in index.tensors.values():
        if tensor.type in CONVERTED and tensor.type not in seen and tensor.shape[0] < 20000:
            seen.add(tensor.type)
            blocks = gguf_blocks(tensor.data, tensor.type, tensor.name)
            assert np.array_equal(dequantize(blocks).numpy(), reference(tensor.data, tensor.type)), tensor.name
    assert seen


@pytest.mark.skipif(not native.available(), reason=f"native kernel: {native.reason()}")
@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
def test_the_kernel_reads_k_quant_scales_factored_with_the_same_results(type_name):
    """A K-quant's scales kept as the file has them (QuantBlocks.factored: a float16 super-block
    scale times a small integer, multiplied in the kernel) give the values and, row for row, the
    products bit for bit that the float32 scales give, in fewer bytes."""
    blocks = gguf_blocks(random_raw(type_name, 48, 512, seed=3), type_name)
    factored = native.NativeWeight.of(blocks)
    wide = native.NativeWeight.of(replace(blocks, factored=None))
    assert factored.code & native.FACTORED and not wide.code & native.FACTORED
    nbytes = lambda w: sum(t.numel() * t.element_size() for t in w.tensors())  # noqa: E731
    codes = blocks.q.numel()  # bytes of codes: the same in both
    per_256 = {"Q4_K": 20, "Q6_K": 18}[type_name]  # block_kinds.h: a super-block's scale bytes
    assert nbytes(factored) == codes + blocks.shape[0] * blocks.shape[1] // 256 * per_256 < nbytes(wide)
    assert torch.equal(native.dequantize_rows(factored, 5, 40), dequantize(blocks)[5:40])
    for rows in (1, 3, 8, 13):
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
        assert torch.equal(native.qmatmul(x, factored), native.qmatmul(x, wide))
    if native.amx_available():
        x = torch.randn(40, 512, generator=torch.Generator().manual_seed(4))
        assert torch.equal(native.amx_matmul(x, factored), native.amx_matmul(x, wide))
