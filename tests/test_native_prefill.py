"""Prefills through the native layer (where the CPU has the AMX tile unit, their products on
matmul_amx.c's tiles) against the torch layers, greedy speculation after a long prompt, and projections
stacked from parts of different kinds (a GGUF's Q and K in one kind, V in another) in the native
layer. The last two on every variant of the library this machine executes (kernel_variants.py).
The paths each CPU takes are checked on every machine by pretending its profile
(tests/cpu_profiles.py); the tile kernel itself runs only where the CPU has it."""

from __future__ import annotations

import pytest
import torch

from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.kernels import dispatch, native
from outrider.kernels.dispatch import PrefillPath
from outrider.models.batch import pack
from outrider.weights.loader import load_decoder
from outrider.kernels.decoder_layer import NativeLayers
from outrider.kernels.blocks import quantize
from outrider.kernels.quant_linear import QuantLinear
from outrider.weights.quant_load import RowStack
from outrider.sampling import SamplingParams
from outrider.engine.speculator import SpecOptions, Speculator
from test_native_layer import make_family
from kernel_variants import ALL, TWO, variant  # noqa: F401  (variant: the fixture)
from cpu_profiles import INTEL_AMX, PROFILES

needs_tiles = pytest.mark.skipif(not native.amx_available(), reason="no AMX tile unit here (or not granted)")

PROMPT = [3, 9, 4, 11, 7, 8, 20, 5] * 5  # 40 tokens: past dispatch.TILE_ROWS


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_family("qwen2", tmp_path_factory.mktemp("prefill") / "qwen2")


def prefill(m, native_on: bool, tokens=PROMPT):
    """The prompt's prefill (no logits), then one decode step; its logits and the cache."""
    m.forward(pack([0], [0], [torch.tensor([5])], logits="none", scratch_row=0), m.new_cache(1, 4))  # choose paths
    saved = m._native
    m._native = saved if native_on else None
    cache = m.new_cache(1, 64)
    m.forward(pack([0], [0], [torch.tensor(tokens)], logits="none", scratch_row=cache.scratch_row), cache)
    m._native = saved
    step = m.forward(pack([0], [len(tokens)], [torch.tensor([12])], scratch_row=cache.scratch_row), cache)
    return step.logits, cache


def fills_of(monkeypatch) -> list:
    """The `fill` code of every NativeLayers.run call from now on (dispatch.PrefillPath.fill)."""
    fills = []
    run = NativeLayers.run
    monkeypatch.setattr(NativeLayers, "run", lambda self, *a, **k: fills.append(k["fill"]) or run(self, *a, **k))
    return fills


def test_a_long_prefill_runs_natively_on_the_tiles(folder, monkeypatch):
    """On a CPU with the tile unit (pretended where this one has none: the path is the rule's, the
    products the hardware's, decoder_layer.c falling back to the row kernel without tiles) the
    prompt's products take the tiles, and its logits and K/V are the torch layers' up to rounding."""
    m = load_decoder(folder, "cpu", "q4")
    fills = fills_of(monkeypatch)
    with dispatch.pretending(INTEL_AMX):
        fast, cache_fast = prefill(m, True)
    assert fills[1] == PrefillPath.TILES.fill  # the prompt: exact products on the tiles (fills[0]: choosing paths)
    slow, cache_slow = prefill(m, False)
    assert torch.allclose(fast, slow, rtol=1e-4, atol=1e-4), (fast - slow).abs().max()
    for layer in range(len(m.layers)):
        assert torch.allclose(cache_fast.k[layer], cache_slow.k[layer], rtol=1e-4, atol=1e-5)
        assert torch.allclose(cache_fast.v[layer], cache_slow.v[layer], rtol=1e-4, atol=1e-5)


@needs_tiles
def test_the_tiles_run_here(folder):
    """Where this CPU has the tile unit, its own profile takes them (no pretending)."""
    m = load_decoder(folder, "cpu", "q4")
    assert m.prefill_path(pack([0], [0], [torch.tensor(PROMPT)], logits="none", scratch_row=0)) == PrefillPath.TILES


def test_a_drafters_long_prefill_takes_the_one_part_form(folder, monkeypatch):
    m = load_decoder(folder, "cpu", "q4")
    m.drafter_prefill_bf16 = True
    fills = fills_of(monkeypatch)
    with dispatch.pretending(INTEL_AMX):
        prefill(m, True)
    assert fills[1] == PrefillPath.TILES_BF16.fill


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.name)
def test_short_or_huge_prefills(folder, monkeypatch, runtime, profile):
    """Each CPU's rule (tests/test_dispatch.py) is what the decoder takes, asked before any forward;
    a workspace past NATIVE_FILL_FLOATS takes the torch layers on every CPU."""
    from outrider.models import decoder as decoder_module

    m = load_decoder(folder, "cpu", "q4")
    short = pack([0], [0], [torch.tensor(PROMPT[: dispatch.TILE_ROWS - 1])], logits="none", scratch_row=0)
    long = pack([0], [0], [torch.tensor(PROMPT)], logits="none", scratch_row=0)
    with dispatch.pretending(profile):
        plan = dispatch.plan()
        assert m.prefill_path(short) == plan.prefill(len(short.tokens[0]))
        assert m.prefill_path(long) == plan.prefill(len(PROMPT))
        if profile is INTEL_AMX:
            assert (m.prefill_path(short), m.prefill_path(long)) == (PrefillPath.NATIVE, PrefillPath.TILES)
        monkeypatch.setattr(decoder_module, "NATIVE_FILL_FLOATS", 1000)
        assert m.prefill_path(long) == PrefillPath.TORCH
        monkeypatch.setattr(decoder_module, "NATIVE_FILL_FLOATS", 1 << 26)
        runtime(amx_prefill=False, gemm_prefill="on")
        assert m.prefill_path(long) == PrefillPath.TORCH


@pytest.mark.parametrize("variant", TWO, indirect=True)
def test_greedy_speculative_equals_autoregressive_after_a_long_prompt(folder, variant):
    m = load_decoder(folder, "cpu", "q4")
    requests = [Request(PROMPT, 24, SamplingParams(0.0)), Request(PROMPT[::-1][:30], 24, SamplingParams(0.0))]
    plain = [f.token_ids for f in generate_ids(m, requests, set())]
    spec = Speculator.build(SpecOptions("ngram", "chain", "fixed:4"), m, folder)
    fast = generate_ids(m, requests, set(), speculation=spec)
    assert [f.token_ids for f in fast] == plain


@pytest.mark.parametrize("variant", ALL, indirect=True)
def test_stacked_projections_run_in_the_native_layer(folder, variant):
    """A qkv stacked from Q and K in Q4_1 and V in Q8_0 (quant_load.RowStack) runs natively,
    each part through the kernel: the torch layer's logits up to float rounding, and each row's
    result bit-identical whatever the other rows."""
    m = load_decoder(folder, "cpu", "q4")
    c = m.config
    for w in m.layers:
        full = native.dequantize_rows(w.qkv.state["weight"], 0, w.qkv.shape[0])  # [(H + 2G) D, E]
        q_and_k = (c.num_heads + c.num_kv_heads) * c.head_dim
        w.qkv = RowStack([QuantLinear(quantize(full[:q_and_k], "q4_1"), kernel="native"),
                          QuantLinear(quantize(full[q_and_k:], "q8_0"), kernel="native")])
    m._linear_paths_chosen = False
    fast, _ = prefill(m, True, PROMPT[:10])
    assert m._native is not None
    slow, _ = prefill(m, False, PROMPT[:10])
    assert torch.allclose(fast, slow, rtol=1e-4, atol=1e-4), (fast - slow).abs().max()
    cache = m.new_cache(1, 64)
    m.forward(pack([0], [0], [torch.tensor(PROMPT[:10])], logits="none", scratch_row=cache.scratch_row), cache)
    together = m.forward(pack([0], [10], [torch.tensor([12, 13, 14])], scratch_row=cache.scratch_row), cache).logits
    alone = [m.forward(pack([0], [10 + i], [torch.tensor([t])], scratch_row=cache.scratch_row), cache).logits
             for i, t in enumerate([12, 13, 14])]
    for i in range(3):
        assert torch.equal(together[0, i], alone[i][0, 0])


@pytest.mark.parametrize("variant", ALL, indirect=True)
def test_a_prompts_cache_is_the_same_bits_whole_chunked_or_row_by_row(folder, variant, runtime):
    """Where the prefill runs in the native layer with outrider_qmatmul's products (no tile unit
    here, or the tiles off), a prompt's K/V are the same bits whether it is prefilled whole (its
    products in qmatmul_fill.c), in chunks of any size (serve's chunked prefill), or one row at a
    time as decode steps: so serve and generate prefill a prompt alike, bit for bit."""
    runtime(amx_prefill=False, gemm_prefill="off")
    m = load_decoder(folder, "cpu", "q4")
    prompt = torch.tensor(PROMPT)  # 40 rows: the fill kernel's products from native.fill_rows() rows
    assert len(PROMPT) >= native.fill_rows() or native.variant() == "portable"

    def filled(chunks):
        cache = m.new_cache(1, 64)
        start = 0
        for size in chunks:
            part = prompt[start:start + size]
            m.forward(pack([0], [start], [part], logits="none", scratch_row=cache.scratch_row), cache)
            start += size
        step = m.forward(pack([0], [start], [torch.tensor([12])], scratch_row=cache.scratch_row), cache).logits
        return cache, step

    whole, logits = filled([40])
    assert m.prefill_path(pack([0], [0], [prompt], logits="none", scratch_row=0)) == PrefillPath.NATIVE
    for chunks in ([7, 13, 20], [1] * 40):
        cache, step = filled(chunks)
        assert torch.equal(step, logits), chunks
        for layer in range(len(m.layers)):
            assert torch.equal(cache.k[layer], whole.k[layer]) and torch.equal(cache.v[layer], whole.v[layer]), chunks


@pytest.mark.parametrize("variant", TWO, indirect=True)
def test_a_prompt_past_the_native_workspace_is_filled_in_parts_with_the_same_bits(folder, variant, monkeypatch,
                                                                                  runtime):
    """A single prompt whose prefill would need more than NATIVE_FILL_FLOATS of workspace runs in
    parts through the native layer (not the torch layers): its K/V are the bits of a whole or a
    chunked prefill, so a long prompt in `generate` and in `serve`'s chunks agree too."""
    from outrider.models import decoder as decoder_module

    runtime(amx_prefill=False, gemm_prefill="off")
    m = load_decoder(folder, "cpu", "q4")
    prompt = torch.tensor(PROMPT)

    def filled():
        cache = m.new_cache(1, 64)
        m.forward(pack([0], [0], [prompt], logits="none", scratch_row=cache.scratch_row), cache)
        return cache

    whole = filled()
    parts = []
    monkeypatch.setattr(decoder_module, "NATIVE_FILL_FLOATS", m._fill_rows_floats(16, len(PROMPT)))
    forward = type(m).forward
    monkeypatch.setattr(type(m), "forward", lambda self, b, c, n=None: parts.append(b.tokens.shape[1]) or forward(self, b, c, n))
    split = filled()
    assert parts == [40, 16, 16, 8]  # the whole call, then its parts
    for layer in range(len(m.layers)):
        assert torch.equal(split.k[layer], whole.k[layer]) and torch.equal(split.v[layer], whole.v[layer])
