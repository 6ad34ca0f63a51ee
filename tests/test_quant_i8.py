"""Int8 activations (the `-i8` dtypes): native/qmatmul_i8.c against its torch reference (kernels/qmatmul_i8_reference.py),
rows bit-identical whatever the batch and the threads, the rounding of x as documented (on each
variant of the library that has the kernel: qmatmul_i8.c in avx512-vnni and amx, qmatmul_i8_avx2.c in
avx2 and avx512), the AVX2 kernel's bits equal to the VNNI kernel's, and the refusal where no kernel
runs (portable). Greedy speculative == autoregressive on `q4-i8` / `q8_0-i8`
models: test_quant_model.py's `quantized` fixture and test_quant_smollm2.py run it.

Tolerance against `reference_linear_i8` (the exact integer block sums, their scales applied in
float64): `rounding_bound`, (groups + 8) float32 roundings of the sum of |terms| (kernels/qmatmul_i8_reference.py
derives it). A wrong code, scale or lane is off by a whole term, far more (the controls check).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from outrider.config import cpu_info
from outrider.errors import ModelError
from outrider.kernels import native
from outrider.kernels.blocks import BLOCK, dequantize, quantize
from outrider.weights.quant_convert import gguf_blocks
from outrider.kernels.qmatmul_i8_reference import quantize_activations, reference_linear_i8, rounding_bound
from test_quant import random_blocks
from test_quant_convert import random_raw
from test_quant_native import assert_rows_bit_identical
from kernel_variants import HERE, I8, variant  # noqa: F401  (variant: the fixture)

needs_lanes = pytest.mark.skipif(not native.i8_available(),
                                 reason=f"int8-activation kernel: {native.reason() or 'no AVX2'}")


def widened(blocks):
    return replace(blocks, d=blocks.d.float(), m=None if blocks.m is None else blocks.m.float())


def all_kinds(cols: int, seed: int = 0) -> dict:
    """Blocks of every form qmatmul_i8.c takes, `cols` values a row (a multiple of 256 for K-quants)."""
    cases = {}
    for kind in ("q8_0", "q4_0", "q4_1"):
        blocks = random_blocks(kind, 21, cols, seed=seed)
        cases[kind] = blocks
        cases[kind + " float32 scales"] = widened(blocks)
    if cols % 256 == 0:
        for type_name in ("Q4_K", "Q6_K"):  # factored scales (block_kinds.h), and the same widened
            blocks = gguf_blocks(random_raw(type_name, 21, cols, seed=seed), type_name)
            cases[type_name] = blocks
            cases[type_name + " float32 scales"] = replace(blocks, factored=None)
    cases["Q5_0"] = gguf_blocks(random_raw("Q5_0", 21, cols, seed=seed), "Q5_0")
    return cases


def test_activations_round_as_documented():
    """quant_i8's docstring example: the largest magnitude maps to 127, the rest to nearest."""
    x = torch.zeros(2, 32)
    x[0, :3] = torch.tensor([0.5, -1.27, 0.02])
    codes, scales = quantize_activations(x)
    assert codes[0, :4].tolist() == [50, -127, 2, 0] and scales[0, 0].item() == pytest.approx(0.01)
    assert codes[1].abs().sum() == 0 and scales[1, 0] == 0  # an all-zero block: scale 0, codes 0
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(0))
    codes, scales = quantize_activations(x)
    back = codes.float().view(5, 3, 32) * scales.unsqueeze(-1)
    assert codes.abs().max() == 127
    assert ((back.view(5, 96) - x).abs() <= scales.repeat_interleave(32, 1) / 2 * (1 + 1e-6)).all()


@needs_lanes
@pytest.mark.parametrize("cols", [32, 96, 448, 512, 576, 800, 768, 1280, 896])  # tails of 1, 3, 14, 0, 2, 9, 8, 8, 12 blocks
@pytest.mark.parametrize("variant", I8, indirect=True)
def test_kernel_equals_the_reference(cols, variant):
    """Every kind and scale form, whole groups of 16 blocks and every shape of tail (dense below
    8 blocks, a short group from 8), 1 to 13 rows."""
    x = torch.randn(13, cols, generator=torch.Generator().manual_seed(cols))
    for name, blocks in all_kinds(cols, seed=cols).items():
        weight = native.NativeWeight.packed(blocks)
        assert weight.q.numel() == weight_bytes(blocks), name  # as many bytes as the blocks: no padding
        for rows in (1, 2, 5, 13):
            got = native.qmatmul(x[:rows], weight).double()
            ref = reference_linear_i8(x[:rows], blocks)
            assert ((got - ref).abs() <= rounding_bound(x[:rows], blocks)).all(), (name, rows)


def weight_bytes(blocks) -> int:
    out, cols = blocks.shape
    w = native.NativeWeight.of(blocks)
    return sum(t.numel() * t.element_size() for t in w.tensors())


@needs_lanes
@pytest.mark.parametrize("variant", I8, indirect=True)
def test_a_wrong_term_is_caught(variant):
    """Negative controls: one weight code changed, or x's rounding a code off, exceed the bound."""
    blocks = random_blocks("q4_1", 8, 576, seed=1)
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(2))
    got = native.qmatmul(x, native.NativeWeight.packed(blocks)).double()
    q = blocks.q.clone()
    q[4, 40] ^= 0x11  # two codes of block 2 of row 4
    assert ((got - reference_linear_i8(x, replace(blocks, q=q))).abs() > rounding_bound(x, blocks)).any()
    codes, scales = quantize_activations(x)
    nudged = x.clone()
    nudged[1, 100] += scales[1, 100 // 32] * 1.5  # one activation a code and a half further
    assert ((got - reference_linear_i8(nudged, blocks)).abs() > rounding_bound(x, blocks)).any()


@needs_lanes
@pytest.mark.parametrize("name", ["q8_0", "q4_0", "q4_1", "q4_1 float32 scales", "Q4_K", "Q6_K", "Q5_0"])
@pytest.mark.parametrize("variant", I8, indirect=True)
def test_rows_are_bit_identical_whatever_the_batch_and_threads(name, variant):
    """A row's result is the same bits alone, among up to 19 rows (tiles of 8 rows share a weight
    row's unpacked codes), at any offset, with 1 or 2 threads: what makes a k-token verify equal
    k one-token steps."""
    for cols in (768, 576) if name not in ("Q4_K", "Q6_K") else (768,):  # a short group's tail (8 blocks), a dense one (2)
        blocks = all_kinds(cols, seed=4)[name]
        weight = native.NativeWeight.packed(blocks)
        x = torch.randn(19, cols, generator=torch.Generator().manual_seed(5))
        assert_rows_bit_identical(weight, x, [(0, 1), (7, 1), (18, 1), (0, 2), (3, 5), (0, 8), (1, 9), (2, 16)])


@needs_lanes
@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("variant", I8, indirect=True)
def test_factored_scales_give_the_same_bits(type_name, variant):
    """A K-quant's scales kept factored in the lanes records (fewer bytes) multiply to the same
    values as widened ones: the same products, bit for bit."""
    blocks = gguf_blocks(random_raw(type_name, 24, 1280, seed=6), type_name)
    factored, wide = native.NativeWeight.packed(blocks), native.NativeWeight.packed(replace(blocks, factored=None))
    assert factored.q.numel() < wide.q.numel()
    for rows in (1, 3, 8, 11):
        x = torch.randn(rows, 1280, generator=torch.Generator().manual_seed(rows))
        assert torch.equal(native.qmatmul(x, factored), native.qmatmul(x, wide))


@needs_lanes
@pytest.mark.parametrize("variant", I8, indirect=True)
def test_close_to_the_float_product_within_the_rounding_of_x(variant):
    """Against x . W with x unrounded: off by at most what rounding x to its codes moves, half a
    code a value, sum over values of |w| * d_x / 2 (plus float32's share)."""
    w = torch.randn(300, 576, generator=torch.Generator().manual_seed(7)) * 0.05
    x = torch.randn(4, 576, generator=torch.Generator().manual_seed(8))
    for kind in ("q8_0", "q4_0", "q4_1"):
        blocks = quantize(w, kind)
        weights = dequantize(blocks).double()  # [out, in]
        got = native.qmatmul(x, native.NativeWeight.packed(blocks)).double()
        _, scales = quantize_activations(x)
        half_code = (scales.double() / 2).repeat_interleave(BLOCK, 1)  # [M, in]
        bound = half_code @ weights.abs().T * (1 + 1e-6) + rounding_bound(x, blocks)
        err = (got - x.double() @ weights.T).abs()
        assert (err <= bound).all(), kind
        assert err.max() > 1e-4 * got.abs().max(), kind  # and it is not the float product: x was rounded


@needs_lanes
def test_the_quantized_linear_and_the_native_layer_take_it(tmp_path):
    """`--dtype q4-i8`: every projection and the head run the i8 kernel, in the blocks' own bytes,
    and the layers as one native call (prefills too: the row kernel is the fast one at any count)."""
    from outrider.weights.loader import load_decoder
    from outrider.kernels.decoder_layer import NativeLayers
    from test_quant_model import make_quantizable

    model = load_decoder(make_quantizable(tmp_path / "model"), "cpu", "q4-i8")
    assert all(getattr(layer, p).kernel == "i8" for layer in model.layers for p in ("qkv", "o", "gate_up", "down"))
    assert model.lm_head.kernel == "i8" and model.lm_head.nbytes() == 96 * 2 * 34  # Q8_0: 34 bytes a block
    layers = NativeLayers.of(model)
    assert layers is not None and layers.lanes


NO_I8 = [pytest.param(v, id=v) for v in HERE if v == "portable"]
VNNI = [v for v in HERE if v in ("amx", "avx512-vnni")]
AVX2_ONLY = [pytest.param(v, id=v) for v in HERE if v in ("avx512", "avx2")]


AVX_VNNI = "avx_vnni" in cpu_info()["isa"]
SUMS = [pytest.param(False, id="vpmaddubsw"),
        pytest.param(True, id="avx-vnni", marks=pytest.mark.skipif(not AVX_VNNI, reason="no AVX-VNNI here"))]


@pytest.mark.skipif(not VNNI, reason="no AVX-512 VNNI here: nothing to compare the AVX2 kernel's bits with")
@pytest.mark.parametrize("avx_vnni", SUMS)
@pytest.mark.parametrize("variant", AVX2_ONLY, indirect=True)
def test_the_avx2_kernel_gives_the_vnni_kernels_bits(variant, avx_vnni):
    """qmatmul_i8_avx2.c (vpmaddubsw, or AVX-VNNI's 256-bit vpdpbusd) and qmatmul_i8.c (vpdpbusd on
    512): the same integer sums and the same float32 operations lane by lane, so the same bits for
    every kind, scale form and tail shape, at any row count; and the same packed bytes."""
    assert native.i8_avx_vnni(avx_vnni) == avx_vnni
    try:
        for cols in (32, 96, 448, 512, 576, 800, 768, 1280):  # tails of 1, 3, 14, 0, 2, 9, 8, 8 blocks
            x = torch.randn(11, cols, generator=torch.Generator().manual_seed(cols + 1))
            x[3, : min(cols, 64)] = 0  # an all-zero block of x: scale 0
            x[4] *= 1e3
            for name, blocks in all_kinds(cols, seed=cols + 2).items():
                weight = native.NativeWeight.packed(blocks)
                got = {rows: native.qmatmul(x[:rows], weight) for rows in (1, 3, 8, 11)}
                with native.use_variant(VNNI[0]):
                    other = native.NativeWeight.packed(blocks)
                    assert torch.equal(weight.q, other.q), (name, cols)
                    want = {rows: native.qmatmul(x[:rows], other) for rows in got}
                for rows in got:
                    assert torch.equal(got[rows], want[rows]), (name, cols, rows, avx_vnni)
    finally:
        native.i8_avx_vnni(True)


@pytest.mark.skipif(not AVX_VNNI, reason="no AVX-VNNI here")
@pytest.mark.parametrize("variant", AVX2_ONLY, indirect=True)
def test_avx_vnni_and_vpmaddubsw_give_the_same_bits_and_match_the_reference(variant):
    """Where the CPU has AVX-VNNI the AVX2 kernel takes it by default (and says so); turned off it
    takes vpmaddubsw: the same outputs, within the reference's bound, bit-identical across rows."""
    assert native.i8_avx_vnni() and "AVX-VNNI" in native.describe()
    x = torch.randn(13, 800, generator=torch.Generator().manual_seed(9))
    try:
        for name, blocks in [(n, b) for c in (768, 800) for n, b in all_kinds(c, seed=c).items()]:
            cols = blocks.shape[1]
            weight = native.NativeWeight.packed(blocks)
            on = native.qmatmul(x[:, :cols], weight)
            assert ((on.double() - reference_linear_i8(x[:, :cols], blocks)).abs()
                    <= rounding_bound(x[:, :cols], blocks)).all(), name
            assert native.i8_avx_vnni(False) is False
            off = native.qmatmul(x[:, :cols], weight)
            native.i8_avx_vnni(True)
            assert torch.equal(on, off), name
        assert_rows_bit_identical(native.NativeWeight.packed(all_kinds(800, seed=12)["q8_0"]), x,
                                  [(0, 1), (5, 1), (0, 8), (2, 11)])
    finally:
        native.i8_avx_vnni(True)


@pytest.mark.parametrize("variant", NO_I8, indirect=True)
def test_a_variant_without_the_kernel_refuses_the_i8_dtypes(variant, tiny_folders):
    """portable: no int8-activation kernel, so no lanes layout and `-i8` refused, in one line."""
    from outrider.weights.loader import load_decoder

    assert not native.i8_available() and "no int8 activations" in native.describe()
    with pytest.raises(RuntimeError, match="int8-activation kernel needs AVX2"):
        native.NativeWeight.packed(random_blocks("q4_0", 16, 64))
    with pytest.raises(ModelError, match="--dtype q4-i8 needs Outrider's int8-activation kernel") as err:
        load_decoder(tiny_folders["llama"], "cpu", "q4-i8")
    assert "\n" not in str(err.value)
    assert "the portable kernel variant has no int8 activations: they need AVX2" in str(err.value)


def test_refused_in_one_line_where_the_kernel_does_not_run(tiny_folders, monkeypatch):
    from outrider.weights.loader import load_decoder

    monkeypatch.setattr(native, "i8_available", lambda: False)
    with pytest.raises(ModelError, match="--dtype q4-i8 needs Outrider's int8-activation kernel.*use --dtype q4"):
        load_decoder(tiny_folders["llama"], "cpu", "q4-i8")


@needs_lanes
def test_a_draft_model_multiplies_with_int8_activations_by_default(tmp_path):
    """No @DTYPE: the draft model's own quantization, with int8 activations (its numerics change
    only its proposals), beside any target; an @DTYPE still decides."""
    from outrider.drafters.draft_model import DraftModel, build
    from outrider.weights.loader import load_decoder
    from outrider.spec.shapes import parse_shape
    from test_quant_model import gguf_folder

    folder = gguf_folder(tmp_path / "gguf")
    for target_dtype, asked, got in [("q4-i8", None, "q4-i8"), ("q4", None, "q4-i8"), ("q4-i8", "q4_0", "q4_0")]:
        target = load_decoder(folder, "cpu", target_dtype)
        drafter = build(DraftModel(str(folder), asked), parse_shape("chain"), target, folder)
        assert drafter.decoder.quantization == got, (target_dtype, asked)


AVX2 = [pytest.param("avx2", id="avx2")] if "avx2" in HERE else [
    pytest.param("none", id="no-avx2", marks=pytest.mark.skip(reason="no AVX2 here"))]


@pytest.mark.parametrize("dtype", ["q4-i8", "q8_0-i8"])
@pytest.mark.parametrize("variant", AVX2, indirect=True)
def test_greedy_speculative_equals_autoregressive_on_the_avx2_kernel(variant, dtype, tmp_path):
    """The avx2 variant (qmatmul_i8_avx2.c, what an AVX2-only CPU runs): an `-i8` model's greedy
    speculative output, chain and tree, is its autoregressive output, token for token."""
    from outrider.engine.generate import generate_ids
    from outrider.engine.request import Request
    from outrider.engine.speculator import SpecOptions, Speculator
    from outrider.sampling import SamplingParams
    from outrider.weights.loader import load_decoder
    from test_native_layer import make_family

    folder = make_family("qwen2", tmp_path / "qwen2")
    m = load_decoder(folder, "cpu", dtype)
    assert native.variant() == "avx2" and m.lm_head.kernel == "i8"
    requests = lambda: [Request([3, 9, 4, 3, 9, 4, 3, 9], 24, SamplingParams(0.0)),  # noqa: E731
                        Request([7, 8, 7, 8, 7], 24, SamplingParams(0.0))]
    plain = [f.token_ids for f in generate_ids(m, requests(), set())]
    for drafter, shape in (("ngram", "chain"), ("early-exit:2", "static:2,1,1")):  # a chain, a tree
        spec = Speculator.build(SpecOptions(drafter, shape, "fixed:4"), m, folder)
        fast = generate_ids(m, requests(), set(), speculation=spec)
        assert [f.token_ids for f in fast] == plain, drafter
        assert sum(f.round_stats.committed for f in fast) > sum(f.round_stats.rounds for f in fast), drafter


@pytest.mark.model
@pytest.mark.parametrize("variant", AVX2, indirect=True)
def test_smollm2_q4_i8_on_the_avx2_kernel_speculates_exactly(variant, smollm2_path, smollm2_tokenizer):
    """The packaged SmolLM2 `q4-i8` on the avx2 variant: greedy speculative == autoregressive."""
    from outrider.engine.generate import generate_ids
    from outrider.engine.request import Request
    from outrider.engine.speculator import SpecOptions, Speculator
    from outrider.weights.loader import load_decoder

    target = load_decoder(smollm2_path, "cpu", "q4-i8")
    assert native.variant() == "avx2" and target.layers[0].qkv.kernel == "i8"
    spec = Speculator.build(SpecOptions("ngram", "chain", "fixed:4"), target, smollm2_path)
    prompts = ["Monday, Tuesday, Wednesday,", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"]
    requests = lambda: [Request(smollm2_tokenizer(p)["input_ids"], 16) for p in prompts]  # noqa: E731
    plain = [f.token_ids for f in generate_ids(target, requests(), set())]
    outs = generate_ids(target, requests(), set(), speculation=spec)
    assert [f.token_ids for f in outs] == plain
    assert sum(f.round_stats.committed for f in outs) > sum(f.round_stats.rounds for f in outs)
