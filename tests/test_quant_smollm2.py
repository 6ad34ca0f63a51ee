"""The packaged SmolLM2-135M with its weights kept quantized (pulled by `make test`).

Its GGUF is Q4_1 (projections) and Q8_0 (the tied embedding and head); the float32 folder beside
it is that GGUF dequantized. So: `--dtype q4` loads the GGUF's own blocks; with the exact float32
kernel it computes what the float32 model computes; quantizing the float32 weights again gives
back the GGUF's blocks byte for byte; and speculative greedy equals plain greedy on it."""

import pytest
import torch
from test_quant import EXACT

pytestmark = pytest.mark.model

PROMPTS = ["Monday, Tuesday, Wednesday,", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"]


@pytest.fixture(scope="module")
def q4(smollm2_path):
    from outrider.weights.loader import load_decoder

    return load_decoder(smollm2_path, "cpu", "q4")


@pytest.fixture(scope="module")
def q4_i8(smollm2_path):
    """The same blocks with int8 activations (qmatmul_i8.c or qmatmul_i8_avx2.c), where a kernel runs."""
    from outrider.kernels import native
    from outrider.weights.loader import load_decoder

    if not native.i8_available():
        pytest.skip("int8-activation kernel: none here (it needs AVX2)")
    return load_decoder(smollm2_path, "cpu", "q4-i8")


def test_requantized_floats_are_the_gguf_blocks(smollm2_path):
    """Q4_1 / Q8_0 blocks dequantized to float32 and quantized again with ggml's rounding are
    the same blocks (each block's codes reach 0 and 15, or +-127, so min and scale come back)."""
    from outrider.weights.loader import _Tensors
    from outrider.kernels.blocks import quantize
    from outrider.weights.quant_load import QuantTensors

    floats = _Tensors(smollm2_path)
    native = QuantTensors(smollm2_path, "q4", floats)
    assert native.source == "GGUF blocks (original.gguf)"
    names = ["model.embed_tokens.weight"] + [
        f"model.layers.{i}.{n}" for i in (0, 17, 29) for n in
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "mlp.down_proj.weight")]
    for name in names:
        blocks = native._weight(name)
        again = quantize(floats.get(name, torch.float32, torch.device("cpu")), blocks.kind)
        assert torch.equal(again.q, blocks.q), name
        assert torch.equal(again.d.view(torch.int16), blocks.d.view(torch.int16)), name
        if blocks.m is not None:
            assert torch.equal(again.m.view(torch.int16), blocks.m.view(torch.int16)), name


def test_gguf_blocks_compute_the_float_model(q4, smollm2_decoder, smollm2_tokenizer):
    """With the float32 kernel, the GGUF's blocks compute what the float32 folder computes."""
    from outrider.models.batch import pack

    assert q4.layers[0].qkv.kind == "q4_1" and q4.lm_head.kind == "q8_0" and q4.lm_head.kernel == EXACT
    ids = torch.tensor(smollm2_tokenizer(PROMPTS[0])["input_ids"])

    def logits(model):
        cache = model.new_cache(1, 64)
        return model.forward(pack([0], [0], [ids], scratch_row=cache.scratch_row), cache).logits[0]

    ref = logits(smollm2_decoder)
    torch.testing.assert_close(logits(q4), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


DRAFTERS = {  # every kind of drafter: lookups, self-speculation, a learned head, a draft model, the hybrid
    "ngram": ("ngram", "chain"), "suffix": ("suffix", "chain"), "early-exit": ("early-exit:8", "static:2,1,1"),
    "eagle3": ("eagle3:smollm2-135m-instruct", "dynamic:3,6"),
    "draft-model": ("draft-model:smollm2-135m-instruct@q4_0", "chain"),
    "hybrid": ("hybrid:2,eagle3:smollm2-135m-instruct", "chain"),
}


@pytest.fixture(scope="module")
def plain_outputs() -> dict[str, list[list[int]]]:
    """Each dtype's greedy output on PROMPTS without drafts, worked out by its first case and
    read by the drafters after it (it does not depend on the drafter)."""
    return {}


@pytest.mark.parametrize("dtype", ["q4", "q4-i8"])
@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_speculative_greedy_equals_autoregressive(request, smollm2_path, smollm2_tokenizer, plain_outputs, drafter,
                                                  dtype):
    """On the quantized model (float32 or int8 activations) every drafter's greedy output is the
    model's own greedy output, token for token."""
    from outrider.engine.generate import generate_ids
    from outrider.engine.request import Request
    from outrider.engine.speculator import SpecOptions, Speculator

    target = request.getfixturevalue("q4" if dtype == "q4" else "q4_i8")
    name, tree = DRAFTERS[drafter]
    spec = Speculator.build(SpecOptions(name, tree, "fixed:4"), target, smollm2_path)
    requests = lambda: [Request(smollm2_tokenizer(p)["input_ids"], 10) for p in PROMPTS]  # noqa: E731
    if dtype not in plain_outputs:
        plain_outputs[dtype] = [f.token_ids for f in generate_ids(target, requests(), set())]
    plain = plain_outputs[dtype]
    outs = generate_ids(target, requests(), set(), speculation=spec)
    assert [f.token_ids for f in outs] == plain
    assert sum(f.round_stats.committed for f in outs) > sum(f.round_stats.rounds for f in outs)  # drafts were accepted
