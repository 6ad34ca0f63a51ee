"""DeepSeek's mixture-of-experts layers (models/deepseek_moe.py on the MoE MLP kind, moe_layer.py)
against transformers' own implementations: small random `DeepseekV2ForCausalLM`s (topk_method
greedy; group_limited_greedy with a q LoRA) and a `DeepseekV3ForCausalLM` (sigmoid router with a
random e_score_correction_bias, noaux_tc groups, renormalised, routed_scaling_factor 2.5; and one
with RoPE on halves, one group, not renormalised), each a
dense first layer then MoE layers with shared experts, give transformers' logits (a whole prefill,
a chunked one, decode steps); greedy speculation (a suffix chain, static draft-model and early-exit trees) equals
plain decoding (also with the experts quantized q8_0); and the comparison fails with the correction bias used in the weights, the
scaling factor dropped, the group selection off, or V3's groups scored by their best expert."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.errors import ModelError
from outrider.models import moe_layer
from outrider.models.config import ModelConfig
from outrider.sampling import SamplingParams
from outrider.weights.loader import load_decoder
from tiny import add_tokenizer, logits_in_steps, saved_references

TOKENS = torch.randint(3, 96, (40,), generator=torch.Generator().manual_seed(2))
PROMPT = [5, 17, 33, 8, 5, 17, 33, 9, 40, 41, 42, 43, 44, 5, 17, 33, 8, 5, 17]
SIZES = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, max_position_embeddings=256,
             bos_token_id=1, eos_token_id=2, pad_token_id=0, rope_parameters={"rope_type": "default", "rope_theta": 100.0},
             n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, n_shared_experts=2,
             first_k_dense_replace=1)
MODELS = {
    "v2-greedy": lambda tf: tf.DeepseekV2ForCausalLM(tf.DeepseekV2Config(
        **SIZES, q_lora_rank=None, topk_method="greedy", routed_scaling_factor=1.5)),
    # 3 of 4 groups' 2 experts from the best 2 groups (by their best expert: with k <= topk_group it
    # would choose as greedy does)
    "v2-group": lambda tf: tf.DeepseekV2ForCausalLM(tf.DeepseekV2Config(
        **{**SIZES, "num_experts_per_tok": 3}, q_lora_rank=20, topk_method="group_limited_greedy", n_group=4, topk_group=2,
        routed_scaling_factor=1.5)),
    "v3": lambda tf: tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(
        **{**SIZES, "num_experts_per_tok": 3}, q_lora_rank=20, n_group=4, topk_group=2, norm_topk_prob=True,
        routed_scaling_factor=2.5)),
    # RoPE on halves, queries in one q_proj, one group, no renormalisation
    "v3-halves": lambda tf: tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(
        **SIZES, q_lora_rank=None, n_group=1, topk_group=1, norm_topk_prob=False, routed_scaling_factor=0.75,
        rope_interleave=False)),
}


def save(name, folder):
    import transformers as tf

    torch.manual_seed(3)
    model = MODELS[name](tf).eval()
    with torch.no_grad():  # larger weights than the init, random norms and correction biases: far from uniform
        for pname, p in model.named_parameters():
            p.mul_(4.0) if p.dim() > 1 else p.normal_(1.0, 0.3)
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.3)
    model.save_pretrained(folder)
    add_tokenizer(folder)
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    torch.set_num_threads(1)
    return saved_references(tmp_path_factory, MODELS, save, TOKENS)



CUTS = {"whole": [0, 40], "chunked": [0, 11, 27, 40], "decode": [0, 33, *range(34, 41)]}


def close(got, want) -> bool:
    return torch.allclose(got, want, atol=2e-5 * float(want.abs().max()), rtol=1e-4)


def test_the_config_is_read(models):
    v2, v3 = models["v2-group"][3].config, models["v3"][3].config
    assert v2.mlp_kinds == ("dense", "moe", "moe") and v3.mlp_kinds == ("dense", "moe", "moe")
    assert (v2.moe.scoring, v2.moe.n_group, v2.moe.topk_group, v2.moe.group_score) == ("softmax", 4, 2, "max")
    assert (v2.moe.routed_scale, v2.moe.norm_topk_prob, v2.moe.shared_size, v2.moe.score_bias) == (1.5, False, 48, False)
    assert models["v2-greedy"][3].config.moe.n_group == 1 and v2.moe.top_k == 3
    assert (v3.moe.scoring, v3.moe.group_score, v3.moe.score_bias, v3.moe.norm_topk_prob) == ("sigmoid", "top2", True, True)
    assert (v3.moe.routed_scale, v3.moe.top_k, v3.architecture, v3.mla.interleaved) == (2.5, 3, "DeepseekV3ForCausalLM", True)
    halves = models["v3-halves"][3].config
    assert (halves.mla.interleaved, halves.moe.n_group, halves.moe.norm_topk_prob) == (False, 1, False)
    layer = models["v3"][3].layers[2]
    assert layer.moe.score_bias.dtype == torch.float32 and layer.moe.shared_gate is None
    assert models["v3"][3].layers[0].moe is None and len(layer.moe.gate_up) == 8


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("cuts", CUTS)
def test_logits_match_transformers(models, name, cuts):
    got, want = logits_in_steps(models[name][3], TOKENS, CUTS[cuts]), models[name][2]
    assert close(got, want), (got - want).abs().max()


def test_greedy_tokens_match_transformers(models):
    reference, model = models["v3"][1], models["v3"][3]
    out = reference.generate(torch.tensor([PROMPT]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    plain = generate_ids(model, [Request(PROMPT, 24, SamplingParams(0.0))], set())[0].token_ids
    assert plain == out[0, len(PROMPT):].tolist() and len(set(plain)) > 4


@pytest.mark.parametrize("name", ["v2-group", "v3"])
@pytest.mark.parametrize("drafter, tree, control", [
    ("suffix", "chain", "fixed:6"),
    ("draft-model", "static:2,2,1", "fixed:3"),  # the model drafts itself: its trees accepted deep
    ("early-exit:2", "static:2,1", "fixed:2"),  # over the target's own latent cache, through its first MoE layer
])
def test_speculation_is_exact(models, name, drafter, tree, control):
    folder, model = models[name][0], models[name][3]
    requests = [Request(PROMPT, 24, SamplingParams(0.0)), Request(PROMPT[3:] + [60, 61], 17, SamplingParams(0.0))]
    plain = [c.token_ids for c in generate_ids(model, requests, set())]
    spec = f"draft-model:{folder}" if drafter == "draft-model" else drafter
    speculator = Speculator.build(SpecOptions(spec, tree, control), model, folder)
    done = generate_ids(model, requests, set(), speculation=speculator)
    assert [c.token_ids for c in done] == plain
    if drafter == "draft-model":
        assert done[0].stats["mean_accepted_length"] > 2


def test_quantized_experts_speculate_exactly(models):
    """--dtype q8_0: every expert's projections quantized at load (the router and bias kept float)."""
    folder = models["v3"][0]
    model = load_decoder(folder, "cpu", "q8_0")
    moe = model.layers[1].moe
    assert not isinstance(moe.gate_up[0], torch.Tensor) and moe.router.dtype == torch.float32
    requests = [Request(PROMPT, 20, SamplingParams(0.0))]
    plain = [c.token_ids for c in generate_ids(model, requests, set())]
    speculator = Speculator.build(SpecOptions(f"draft-model:{folder}", "static:2,2,1", "fixed:3"), model, folder)
    assert [c.token_ids for c in generate_ids(model, requests, set(), speculation=speculator)] == plain


def test_router_and_bias_stay_float32_in_a_bfloat16_load(models):
    """As transformers keeps them (_keep_in_fp32_modules_strict): the file's float32 values."""
    from safetensors.torch import load_file

    folder = models["v3"][0]
    tensors = load_file(str(folder / "model.safetensors"))
    moe = load_decoder(folder, "cpu", torch.bfloat16).layers[2].moe
    assert moe.router.dtype == torch.float32 and moe.score_bias.dtype == torch.float32
    assert torch.equal(moe.score_bias, tensors["model.layers.2.mlp.gate.e_score_correction_bias"].float())
    assert moe.gate_up[0].dtype == torch.bfloat16


def _moe(model, **changes):
    c = model.config
    model.config = dataclasses.replace(c, moe=dataclasses.replace(c.moe, **changes))


MUTANTS = {
    "v3: correction bias in the weights": ("v3", None),
    "v3: scaling factor dropped": ("v3", dict(routed_scale=1.0)),
    "v2: scaling factor dropped": ("v2-greedy", dict(routed_scale=1.0)),
    "v3: group selection off": ("v3", dict(n_group=1, topk_group=1)),
    "v2: group selection off": ("v2-group", dict(n_group=1, topk_group=1)),
    "v3: groups scored by their best expert": ("v3", dict(group_score="max")),
    "v3: not renormalised": ("v3", dict(norm_topk_prob=False)),
}


@pytest.mark.parametrize("mutant", MUTANTS)
def test_the_checks_catch(models, mutant, monkeypatch):
    name, changes = MUTANTS[mutant]
    folder, want = models[name][0], models[name][2]
    model = load_decoder(folder, "cpu", torch.float32)
    if changes is None:
        monkeypatch.setattr(moe_layer, "_chosen_weights", lambda scores, choice, experts: choice.gather(1, experts))
    else:
        _moe(model, **changes)
    assert not close(logits_in_steps(model, TOKENS, CUTS["chunked"]), want)


def test_what_transformers_and_deepseek_disagree_on_is_refused(models):
    raw = json.loads((models["v2-greedy"][0] / "config.json").read_text())
    for change, words in (({"norm_topk_prob": True}, "norm_topk_prob: true"), ({"moe_layer_freq": 2}, "moe_layer_freq: 2"),
                          ({"topk_method": "noaux_tc"}, "topk_method 'noaux_tc'"),
                          ({"scoring_func": "sigmoid"}, "scoring_func 'sigmoid'"),
                          ({"topk_method": "group_limited_greedy", "n_group": None}, "needs n_group and topk_group"),
                          ({"topk_method": "group_limited_greedy", "n_group": 8, "topk_group": 1}, "more than the topk_group")):
        with pytest.raises(ModelError, match=words) as err:
            ModelConfig.from_dict({**raw, **change})
        assert "\n" not in str(err.value)
    assert ModelConfig.from_dict({**raw, "n_routed_experts": None}).mlp_kinds == ()  # no experts: dense
    assert ModelConfig.from_dict({**raw, "first_k_dense_replace": 3}).mlp_kinds == ()
    assert ModelConfig.from_dict({**raw, "moe_layer_freq": 1, "scoring_func": "softmax"}).moe.top_k == 2


def test_models_check_names_the_router(models, capsys):
    from outrider.cli import main

    assert main(["models", "check", str(models["v3"][0])]) == 0
    line = capsys.readouterr().out.strip()
    assert "DeepseekV3ForCausalLM, 3 layers (latent attention" in line, line
    assert "MoE MLPs in 2 layers (8 experts, top 3 in 2 of 4 groups by sigmoid, times 2.5, a shared expert)" in line, line
