"""Qwen3-MoE, Mixtral and OLMoE (models/qwen3_moe.py, mixtral.py, olmoe.py on the MoE MLP kind,
moe_layer.py) against transformers' own implementations on small random configs it saves: a
Qwen3-MoE with a dense layer (mlp_only_layers) and renormalised top 2 of 8; a Mixtral (top 2 of 6,
always renormalised, Mixtral's `block_sparse_moe.experts.{e}.w1/w3/w2` names) without a window and
one with sliding_window 16 over 40 tokens; an OLMoE (q/k norms over the whole projection, top 3 of
6, not renormalised). Each gives transformers' logits (a whole prefill, a chunked one, decode
steps) and greedy tokens; greedy speculation (a suffix chain, a static draft-model tree, an
early-exit tree) equals plain decoding; and the comparison fails with the renormalisation dropped
or added, k off by one, gate and up swapped, the window ignored, or OLMoE's norms taken per head."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.errors import ModelError
from outrider.models.config import ModelConfig
from outrider.sampling import SamplingParams
from outrider.weights import mlp_load
from outrider.weights.loader import load_decoder
from tiny import add_tokenizer, logits_in_steps, saved_references

TOKENS = torch.randint(3, 96, (40,), generator=torch.Generator().manual_seed(5))
PROMPT = [5, 17, 33, 8, 5, 17, 33, 9, 40, 41, 42, 43, 44, 5, 17, 33, 8, 5, 17]
SIZES = dict(vocab_size=96, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0, rms_norm_eps=1e-5)
MODELS = {
    "qwen3-moe": lambda tf: tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(
        **SIZES, head_dim=16, intermediate_size=112, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1])),
    # the layout train/moe_split.py writes: biases on q, k, v; a gated shared expert; top 2 of 6
    "qwen2-moe": lambda tf: tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(
        **SIZES, intermediate_size=112, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        num_experts=6, num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[1])),
    "mixtral": lambda tf: tf.MixtralForCausalLM(tf.MixtralConfig(
        **SIZES, intermediate_size=40, num_local_experts=6, num_experts_per_tok=2, sliding_window=None)),
    "mixtral-window": lambda tf: tf.MixtralForCausalLM(tf.MixtralConfig(
        **SIZES, intermediate_size=40, num_local_experts=6, num_experts_per_tok=2, sliding_window=16)),
    "olmoe": lambda tf: tf.OlmoeForCausalLM(tf.OlmoeConfig(
        **SIZES, intermediate_size=40, num_experts=6, num_experts_per_tok=3, norm_topk_prob=False)),
}
CUTS = {"whole": [0, 40], "chunked": [0, 11, 27, 40], "decode": [0, 33, *range(34, 41)]}


def save(name, folder):
    import transformers as tf

    torch.manual_seed(4)
    model = MODELS[name](tf).eval()
    with torch.no_grad():  # larger weights than the init, random norms and biases: logits far from uniform
        for key, p in model.named_parameters():
            p.mul_(4.0) if p.dim() > 1 else p.normal_(0.0 if key.endswith("bias") else 1.0, 0.3)
    model.save_pretrained(folder)
    add_tokenizer(folder)
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    torch.set_num_threads(1)
    return saved_references(tmp_path_factory, MODELS, save, TOKENS)


def close(got, want) -> bool:
    return torch.allclose(got, want, atol=2e-5 * float(want.abs().max()), rtol=1e-4)


def test_the_configs_are_read(models):
    qwen, mixtral, window, olmoe, qwen2 = (models[n][3].config for n in
                                           ("qwen3-moe", "mixtral", "mixtral-window", "olmoe", "qwen2-moe"))
    assert qwen2.mlp_kinds == ("moe", "dense", "moe") and qwen2.qkv_bias and not qwen2.qk_norm
    assert (qwen2.moe.top_k, qwen2.moe.norm_topk_prob, qwen2.moe.shared_size, qwen2.moe.shared_gate) == (2, False, 48, True)
    assert qwen.mlp_kinds == ("moe", "dense", "moe") and qwen.qk_norm and not qwen.qk_norm_whole
    assert (qwen.moe.num_experts, qwen.moe.top_k, qwen.moe.expert_size, qwen.moe.norm_topk_prob) == (8, 2, 32, True)
    assert qwen.moe.shared_size == 0 and models["qwen3-moe"][3].layers[1].moe is None
    assert mixtral.mlp_kinds == ("moe",) * 3 and mixtral.layer_windows == () and not mixtral.qk_norm
    assert (mixtral.moe.num_experts, mixtral.moe.top_k, mixtral.moe.expert_size, mixtral.moe.norm_topk_prob) == (6, 2, 40, True)
    assert window.layer_windows == (16, 16, 16)
    assert olmoe.qk_norm_whole and (olmoe.moe.top_k, olmoe.moe.norm_topk_prob, olmoe.moe.expert_size) == (3, False, 40)
    layer = models["olmoe"][3].layers[0]
    assert layer.q_norm.shape == (64,) and layer.k_norm.shape == (32,)  # H D and G D
    raw = json.loads((models["mixtral"][0] / "config.json").read_text())
    assert "num_local_experts" in raw and "norm_topk_prob" not in raw  # Mixtral always renormalises


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("cuts", CUTS)
def test_logits_match_transformers(models, name, cuts):
    got, want = logits_in_steps(models[name][3], TOKENS, CUTS[cuts]), models[name][2]
    assert close(got, want), (got - want).abs().max()


def test_the_window_is_in_the_reference(models):
    """The windowed Mixtral (the same weights: the same seed) gives the unwindowed one's logits up
    to token 16 and others past it."""
    plain, windowed = models["mixtral"][2], models["mixtral-window"][2]
    assert close(windowed[:16], plain[:16]) and not close(windowed[17:], plain[17:])


@pytest.mark.parametrize("name", MODELS)
def test_greedy_tokens_match_transformers(models, name):
    reference, model = models[name][1], models[name][3]
    out = reference.generate(torch.tensor([PROMPT]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    plain = generate_ids(model, [Request(PROMPT, 24, SamplingParams(0.0))], set())[0].token_ids
    # the tiny Qwen2-MoE settles into a two-token repeat here; its logits (above) are the finer check
    assert plain == out[0, len(PROMPT):].tolist() and len(set(plain)) > (1 if name == "qwen2-moe" else 4)


@pytest.mark.parametrize("name", ["qwen3-moe", "mixtral-window", "olmoe", "qwen2-moe"])  # the unwindowed Mixtral: sparsespec's
@pytest.mark.parametrize("drafter, tree, control", [
    ("suffix", "chain", "fixed:6"),
    ("draft-model", "static:2,2,1", "fixed:3"),  # the model drafts itself: its trees accepted deep
    ("early-exit:2", "static:2,1", "fixed:2"),  # the target's first two layers over its own cache
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
    """--dtype q8_0: every expert's projections, Mixtral's names included, quantized at load."""
    folder = models["mixtral-window"][0]
    model = load_decoder(folder, "cpu", "q8_0")
    assert not isinstance(model.layers[0].moe.gate_up[0], torch.Tensor)
    requests = [Request(PROMPT, 20, SamplingParams(0.0))]
    plain = [c.token_ids for c in generate_ids(model, requests, set())]
    speculator = Speculator.build(SpecOptions(f"draft-model:{folder}", "static:2,2,1", "fixed:3"), model, folder)
    assert [c.token_ids for c in generate_ids(model, requests, set(), speculation=speculator)] == plain


def _moe(model, **changes):
    c = model.config
    model.config = dataclasses.replace(c, moe=dataclasses.replace(c.moe, **changes))


def _per_head_norms(model):
    """OLMoE's norms taken one a head: each head normed alone with the first D weights."""
    D = model.config.head_dim
    model.config = dataclasses.replace(model.config, qk_norm_whole=False)
    for w in model.layers:
        w.q_norm, w.k_norm = w.q_norm[:D], w.k_norm[:D]


MUTANTS = {
    "mixtral: not renormalised": ("mixtral", lambda m: _moe(m, norm_topk_prob=False)),
    "qwen3-moe: not renormalised": ("qwen3-moe", lambda m: _moe(m, norm_topk_prob=False)),
    "olmoe: renormalised": ("olmoe", lambda m: _moe(m, norm_topk_prob=True)),
    "qwen3-moe: k one less": ("qwen3-moe", lambda m: _moe(m, top_k=1)),
    "mixtral: k one more": ("mixtral", lambda m: _moe(m, top_k=3)),
    "olmoe: k one less": ("olmoe", lambda m: _moe(m, top_k=2)),
    "mixtral: window ignored": ("mixtral-window", lambda m: setattr(
        m, "config", dataclasses.replace(m.config, layer_windows=()))),
    "mixtral: window one longer": ("mixtral-window", lambda m: setattr(
        m, "config", dataclasses.replace(m.config, layer_windows=(17,) * 3))),
    "olmoe: q/k norms per head": ("olmoe", _per_head_norms),
    "mixtral: w1 and w3 swapped": ("mixtral", None),
}


@pytest.mark.parametrize("mutant", MUTANTS)
def test_the_checks_catch(models, mutant, monkeypatch):
    name, change = MUTANTS[mutant]
    folder, want = models[name][0], models[name][2]
    if change is None:
        monkeypatch.setattr(mlp_load, "MIXTRAL_EXPERT_NAMES", ("w3", "w1", "w2"))
    model = load_decoder(folder, "cpu", torch.float32)
    if change is not None:
        change(model)
    assert not close(logits_in_steps(model, TOKENS, CUTS["chunked"]), want)


@pytest.mark.parametrize("step, dense", [(1, []), (2, []), (3, [2]), (1, [0, 3]), (2, [1])])
def test_which_qwen3_moe_mlps_are_sparse_is_transformers_rule(step, dense):
    import transformers as tf
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer, Qwen3MoeSparseMoeBlock

    config = tf.Qwen3MoeConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=6,
                               num_attention_heads=1, num_key_value_heads=1, head_dim=8, num_experts=2,
                               num_experts_per_tok=1, moe_intermediate_size=4, decoder_sparse_step=step,
                               mlp_only_layers=dense)
    theirs = tuple("moe" if isinstance(Qwen3MoeDecoderLayer(config, i).mlp, Qwen3MoeSparseMoeBlock) else "dense"
                   for i in range(6))
    raw = {**config.to_dict(), "architectures": ["Qwen3MoeForCausalLM"]}
    assert ModelConfig.from_dict(raw).mlp_kinds in (theirs, ())  # (): dense everywhere
    assert (ModelConfig.from_dict(raw).mlp_kinds or ("dense",) * 6) == theirs


def test_what_is_not_implemented_is_refused_in_one_line(models):
    olmoe = json.loads((models["olmoe"][0] / "config.json").read_text())
    qwen = json.loads((models["qwen3-moe"][0] / "config.json").read_text())
    for raw, words in (({**olmoe, "clip_qkv": 8.0}, "q, k and v clipped"),
                       ({**qwen, "use_sliding_window": True, "sliding_window": 16}, "sliding-window attention"),
                       ({**qwen, "num_experts_per_tok": 9}, "between 1 and num_experts")):
        with pytest.raises(ModelError, match=words) as err:
            ModelConfig.from_dict(raw)
        assert "\n" not in str(err.value)
    assert ModelConfig.from_dict({**olmoe, "clip_qkv": None}).qk_norm_whole


def test_models_check_names_the_experts(models, capsys):
    from outrider.cli import main

    assert main(["models", "check", str(models["mixtral-window"][0])]) == 0
    line = capsys.readouterr().out.strip()
    assert "MixtralForCausalLM, 3 layers" in line and "MoE MLPs in 3 layers (6 experts, top 2)" in line, line


@pytest.mark.parametrize("spec", [[], ["--drafter", "suffix"], ["--drafter", "draft-model:{folder}", "--tree", "static:2,2,1"]])
def test_generate_gives_transformers_tokens_from_the_command_line(models, spec, capsys, monkeypatch):
    """Issue 41's check: a Qwen3-MoE saved by transformers, under `outrider generate`, plain, with
    suffix drafts and with a static tree, gives transformers' greedy tokens."""
    from outrider.cli import main

    folder, reference = models["qwen3-moe"][0], models["qwen3-moe"][1]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = [a.format(folder=folder) for a in spec]
    code = main(["generate", "--model", str(folder), "--json", "--max-new-tokens", "20", *args,
                 " ".join(f"w{t}" for t in PROMPT)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    ids = json.loads(captured.out)["token_ids"]
    out = reference.generate(torch.tensor([PROMPT]), max_new_tokens=20, do_sample=False, eos_token_id=2, pad_token_id=0)
    assert ids == out[0, len(PROMPT):].tolist()[: len(ids)] and len(ids) > 10


@pytest.mark.parametrize("name", ["olmoe", "mixtral"])
def test_sparsespec_drafts_exactly_on_them(models, name):
    """sparsespec reads the target's K/V rows and its queries (OLMoE's through its whole-projection
    norms): greedy output equals plain (a windowed Mixtral is refused in one line: its rows are in rings)."""
    folder, model = models[name][0], models[name][3]
    requests = [Request(PROMPT * 2, 20, SamplingParams(0.0))]
    plain = [c.token_ids for c in generate_ids(model, requests, set())]
    speculator = Speculator.build(SpecOptions("sparsespec:10,1,2", "chain", "fixed:3"), model, folder)
    assert [c.token_ids for c in generate_ids(model, requests, set(), speculation=speculator)] == plain


@pytest.mark.parametrize("name, drafter, tree", [("qwen3-moe", "ngram", "chain"), ("olmoe", "draft-model", "dynamic:3,6"),
                                                 ("mixtral-window", "early-exit:1", "dynamic:2,4")])
def test_other_drafters_and_dynamic_trees_are_exact(models, name, drafter, tree):
    folder, model = models[name][0], models[name][3]
    requests = [Request(PROMPT, 20, SamplingParams(0.0))]
    plain = [c.token_ids for c in generate_ids(model, requests, set())]
    spec = f"draft-model:{folder}" if drafter == "draft-model" else drafter
    speculator = Speculator.build(SpecOptions(spec, tree, "fixed:3"), model, folder)
    assert [c.token_ids for c in generate_ids(model, requests, set(), speculation=speculator)] == plain
