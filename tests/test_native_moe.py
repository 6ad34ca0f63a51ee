"""A mixture of experts on the native decoder layer (kernels/decoder_layer.py, decoder_layer.c with
I = 0: attention only, then moe_layer.moe_mlp in torch): tiny quantized Qwen3-MoE (a dense layer
between MoE layers), Qwen2-MoE (a gated shared expert) and Mixtral saved by transformers give the
torch layer's logits (the reference) within float rounding for a whole prefill, a chunked one and
decode steps; a verify's rows are one-token steps bit for bit (the float router and shared gate
multiplied row by row where the experts are kept quantized: moe_layer.row_exact_linear), on the
native layer and on the torch layer; greedy speculation equals plain; OLMoE (q/k norms over the
whole projection) and float loads keep the torch layers."""

from __future__ import annotations

import pytest
import torch

from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.kernels import native
from outrider.kernels.decoder_layer import NativeLayers
from outrider.sampling import SamplingParams
from outrider.weights.loader import load_decoder
from tiny import add_tokenizer, logits_in_steps

pytestmark = pytest.mark.skipif(not native.available(), reason="the native library does not build here")

TOKENS = torch.randint(3, 96, (24,), generator=torch.Generator().manual_seed(1))
PROMPT = [60, 61, 62, 63, 12, 30, 31, 9, 4]
CUTS = {"whole": [0, 24], "chunked": [0, 9, 17, 24], "decode": [0, 17, *range(18, 25)]}
SIZES = dict(vocab_size=96, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
MODELS = {
    "qwen3-moe": lambda tf: tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(
        **SIZES, head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=[1])),
    "qwen2-moe": lambda tf: tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(
        **SIZES, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=6,
        num_experts_per_tok=2)),
    "mixtral": lambda tf: tf.MixtralForCausalLM(tf.MixtralConfig(
        **SIZES, intermediate_size=32, num_local_experts=6, num_experts_per_tok=2)),
    "olmoe": lambda tf: tf.OlmoeForCausalLM(tf.OlmoeConfig(
        **SIZES, intermediate_size=32, num_experts=6, num_experts_per_tok=2)),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    import transformers as tf

    torch.set_num_threads(1)
    out = {}
    for name, build in MODELS.items():
        torch.manual_seed(4)
        model = build(tf).eval()
        with torch.no_grad():  # larger weights than the init, random norms: logits far from uniform
            for p in model.parameters():
                p.mul_(4.0) if p.dim() > 1 else p.normal_(1.0, 0.3)
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        out[name] = add_tokenizer(folder)
    return out


def torch_layers(model):
    """The same model on the torch layers (the reference): no native layer chosen."""
    model._choose_linear_paths()
    model._native = None
    model._choose_linear_paths = lambda: None
    return model


@pytest.mark.parametrize("name", ["qwen3-moe", "qwen2-moe", "mixtral"])
def test_the_native_attention_with_torch_experts_is_the_torch_layer(folders, name):
    model = load_decoder(folders[name], "cpu", "q8_0")
    native_layers = NativeLayers.of(model)
    assert native_layers is not None
    assert native_layers.moe == ((True, False, True) if name == "qwen3-moe" else (True,) * 3)
    reference = torch_layers(load_decoder(folders[name], "cpu", "q8_0"))
    for cuts in CUTS.values():
        got, want = logits_in_steps(model, TOKENS, cuts), logits_in_steps(reference, TOKENS, cuts)
        assert model._native is not None
        assert torch.allclose(got, want, atol=1e-5 * float(want.abs().max())), (got - want).abs().max()


@pytest.mark.parametrize("layers", ["native", "torch"])
@pytest.mark.parametrize("name", ["qwen3-moe", "qwen2-moe", "mixtral"])
def test_a_verifys_rows_are_one_token_steps_bit_for_bit(folders, name, layers):
    """Rows 17..23 in one forward (a verify) and one at a time (decode) give the same bits: the
    native attention and the experts' row kernel are each row's own bits, and so are the float
    router's (and Qwen2-MoE's shared gate's) products, multiplied row by row; a BLAS product of
    the 7 rows (layers.linear) differs in the last bits, which a near-tie in routing or in the
    argmax would turn into another token."""
    model = load_decoder(folders[name], "cpu", "q8_0")
    if layers == "torch":
        model = torch_layers(model)
    verify, steps = logits_in_steps(model, TOKENS, [0, 17, 24])[17:], logits_in_steps(model, TOKENS, CUTS["decode"])[17:]
    assert torch.equal(verify, steps), (verify - steps).abs().max()


@pytest.mark.parametrize("name", ["qwen3-moe", "mixtral"])
def test_speculation_on_the_native_moe_is_exact(folders, name):
    folder = folders[name]
    model = load_decoder(folder, "cpu", "q8_0")
    requests = [Request(PROMPT, 16, SamplingParams(0.0)), Request(PROMPT[::-1], 12, SamplingParams(0.0))]
    plain = [f.token_ids for f in generate_ids(model, requests, set())]
    assert model._native is not None and len(set(plain[0])) > 3
    for drafter, tree in (("suffix", "chain"), (f"draft-model:{folder}", "static:2,2,1")):
        spec = Speculator.build(SpecOptions(drafter, tree, "fixed:3"), model, folder)
        assert [f.token_ids for f in generate_ids(model, requests, set(), speculation=spec)] == plain


def test_what_the_native_layer_does_not_run_keeps_the_torch_layers(folders):
    assert NativeLayers.of(load_decoder(folders["olmoe"], "cpu", "q8_0")) is None  # q/k norms over all heads
    assert NativeLayers.of(load_decoder(folders["qwen3-moe"], "cpu", torch.float32)) is None  # float weights
