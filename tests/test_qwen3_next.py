"""Qwen3-Next (gated-delta layers with Qwen3-Next's grouped projections, gated attention every
fourth layer, mixture-of-experts MLPs with a gated shared expert, one dense MLP layer) against
transformers' own implementation, mutants of the MoE block and of the projections' grouping that
the comparison catches, speculation on it equal to plain decoding, and its weights' refusals."""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.errors import ModelError
from outrider.models.batch import pack
from outrider.sampling import SamplingParams
from outrider.weights.loader import load_decoder
from tiny import add_tokenizer, make_tiny

PROMPT = [5, 17, 33, 8, 5, 17, 33, 9, 40, 41]
TOKENS = torch.tensor([3, 9, 4, 11, 7, 8, 20, 5, 3, 9, 60, 61, 62, 63, 12, 30, 31, 2, 9, 4])
CLOSE = dict(atol=2e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = make_tiny("qwen3_next", tmp_path_factory.mktemp("qwen3_next") / "qwen3_next", layers=4)
    add_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def reference(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def model(folder):
    return load_decoder(folder, "cpu", torch.float32)


@pytest.fixture(scope="module")
def want(reference):
    with torch.no_grad():
        return reference(TOKENS[None]).logits[0]  # [T, vocab]


def _whole(model) -> torch.Tensor:
    cache = model.new_cache(1, 32)
    return model.forward(pack([0], [0], [TOKENS], scratch_row=cache.scratch_row), cache).logits[0]


def test_the_layers_and_their_mlps_are_read(model):
    c = model.config
    assert c.layer_kinds == ("gated_delta", "gated_delta", "gated_delta", "attention")
    assert c.mlp_kinds == ("moe", "dense", "moe", "moe")  # mlp_only_layers [1]
    assert (c.moe.num_experts, c.moe.top_k, c.moe.expert_size, c.moe.shared_size) == (8, 2, 32, 64)
    assert c.moe.norm_topk_prob and c.moe.shared_gate and c.delta.grouped
    assert model.layers[1].moe is None and model.layers[0].gate_up is None
    assert len(model.layers[3].moe.gate_up) == 8 and model.layers[3].qkv is not None


def test_logits_match_transformers_whole_chunked_and_stepwise(model, want):
    whole = _whole(model)
    assert torch.allclose(whole, want, **CLOSE), (whole - want).abs().max()
    cache = model.new_cache(1, 32)  # a prefill in chunks (folded as it goes), then one token a step
    for start, stop in ((0, 5), (5, 12)):
        model.forward(pack([0], [start], [TOKENS[start:stop]], logits="none", scratch_row=cache.scratch_row), cache)
        cache.set_length(0, stop)
    steps = []
    for i in range(12, len(TOKENS)):
        steps.append(model.forward(pack([0], [i], [TOKENS[i:i + 1]], scratch_row=cache.scratch_row), cache).logits[0, 0])
        cache.set_length(0, i + 1)
    got = torch.stack(steps)
    assert torch.allclose(got, want[12:], **CLOSE), (got - want[12:]).abs().max()


def _top_k(model, k):
    c = model.config
    model.config = dataclasses.replace(c, moe=dataclasses.replace(c.moe, top_k=k))


def _no_renorm(model):
    c = model.config
    model.config = dataclasses.replace(c, moe=dataclasses.replace(c.moe, norm_topk_prob=False))


def _no_shared_gate(model):
    for w in model.layers:
        if w.moe is not None:
            w.moe.shared_gate = None


def _ungrouped(model, folder):  # in_proj_qkvz / in_proj_ba read as Qwen3.5's q k v z b a rows
    tensors = load_file(str(next(folder.glob("*.safetensors"))))
    for i, w in enumerate(model.layers):
        if w.delta is not None:
            p = f"model.layers.{i}.linear_attn."
            w.delta.in_proj = torch.cat((tensors[p + "in_proj_qkvz.weight"], tensors[p + "in_proj_ba.weight"]))


MUTANTS = {"top_k-1": lambda m, f: _top_k(m, 1), "top_k+1": lambda m, f: _top_k(m, 3),
           "no-renormalisation": lambda m, f: _no_renorm(m), "no-shared-gate": lambda m, f: _no_shared_gate(m),
           "projections-ungrouped": _ungrouped}


@pytest.mark.parametrize("mutant", MUTANTS)
def test_a_mutant_of_the_block_is_caught(model, folder, want, mutant):
    """Each mutant's logits miss transformers' by far more than the comparison's tolerance."""
    mutated = copy.deepcopy(model)
    MUTANTS[mutant](mutated, folder)
    assert not torch.allclose(_whole(mutated), want, atol=100 * CLOSE["atol"], rtol=100 * CLOSE["rtol"])


def test_greedy_generation_matches_transformers(model, reference):
    out = reference.generate(torch.tensor([PROMPT]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    ours = generate_ids(model, [Request(PROMPT, 24, SamplingParams(0.0))], set())[0].token_ids
    assert ours == out[0, len(PROMPT):].tolist()


SPECS = [("suffix", "chain"), ("draft-model:{folder}", "static:2,2,1"), ("early-exit:2", "static:2,2")]


@pytest.mark.parametrize("drafter, tree", SPECS, ids=[f"{d.split(':')[0]}-{t}" for d, t in SPECS])
def test_greedy_speculation_equals_plain_decoding(model, folder, drafter, tree):
    requests = [Request(PROMPT, 24, SamplingParams(0.0)), Request(PROMPT[::-1], 20, SamplingParams(0.0))]
    plain = [f.token_ids for f in generate_ids(model, requests, set())]
    spec = Speculator.build(SpecOptions(drafter.format(folder=folder), tree, "fixed:4"), model, folder)
    fast = generate_ids(model, requests, set(), speculation=spec)
    assert [f.finish_reason for f in fast] == ["length", "length"], [f.error for f in fast]
    assert [f.token_ids for f in fast] == plain
    if drafter.startswith("draft-model"):
        assert fast[0].stats["mean_accepted_length"] > 2.5  # the tree really committed deep paths


def test_experts_kept_quantized_are_the_dequantized_model(folder):
    """--dtype q8_0: every expert's, the shared expert's and the mixers' projections in GGUF blocks
    (the router and the shared expert's gate kept float): the float model holding the blocks'
    values, up to float rounding."""
    from outrider.kernels.blocks import dequantize, quantize

    quantized = load_decoder(folder, "cpu", "q8_0")
    floats = load_decoder(folder, "cpu", torch.float32)
    assert not isinstance(quantized.layers[0].moe.gate_up[0], torch.Tensor)  # kept as blocks
    dq = lambda w: w if w.shape[1] % 32 else dequantize(quantize(w, "q8_0")).float()  # noqa: E731  (as the loader)
    for w in floats.layers:
        for name in ("qkv", "o", "gate", "gate_up", "down"):
            if getattr(w, name) is not None:
                setattr(w, name, dq(getattr(w, name)))
        if w.delta is not None:
            w.delta.in_proj, w.delta.out = dq(w.delta.in_proj), dq(w.delta.out)
        if w.moe is not None:
            w.moe.gate_up, w.moe.down = [dq(m) for m in w.moe.gate_up], [dq(m) for m in w.moe.down]
            w.moe.shared_gate_up, w.moe.shared_down = dq(w.moe.shared_gate_up), dq(w.moe.shared_down)
    floats.lm_head, floats.embed = dq(floats.lm_head), dq(floats.embed)
    got, want = _whole(quantized), _whole(floats)
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()


def test_greedy_speculation_on_a_q4_moe_equals_plain(folder):
    model = load_decoder(folder, "cpu", "q4")
    requests = [Request(PROMPT, 20, SamplingParams(0.0))]
    plain = [f.token_ids for f in generate_ids(model, requests, set())]
    spec = Speculator.build(SpecOptions("early-exit:2", "static:2,2", "fixed:3"), model, folder)
    assert [f.token_ids for f in generate_ids(model, requests, set(), speculation=spec)] == plain


def _rewritten(folder, tmp_path, change) -> "Path":  # noqa: F821
    out = tmp_path / "changed"
    shutil.copytree(folder, out)
    path = next(out.glob("*.safetensors"))
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return out


def test_transformers_fused_expert_layout_loads_as_float_only(folder, want, tmp_path):
    """experts.gate_up_proj [N, 2I, E] and experts.down_proj [N, E, I] (transformers 5's layout in
    memory): the same model in float32; a quantized load of it is refused in one line."""
    fused = _rewritten(folder, tmp_path, _fused)
    got = _whole(load_decoder(fused, "cpu", torch.float32))
    assert torch.allclose(got, want, **CLOSE), (got - want).abs().max()
    with pytest.raises(ModelError, match="fused layout are read as float only") as err:
        load_decoder(fused, "cpu", "q8_0")
    assert "\n" not in str(err.value)


def test_an_expert_the_config_does_not_name_refuses_the_load(folder, tmp_path):
    def extra(tensors):
        for n in ("gate", "up", "down"):
            tensors[f"model.layers.0.mlp.experts.8.{n}_proj.weight"] = tensors[f"model.layers.0.mlp.experts.7.{n}_proj.weight"].clone()

    with pytest.raises(ModelError, match=r"does not read \(model\.layers\.0\.mlp\.experts\.8\.down_proj") as err:
        load_decoder(_rewritten(folder, tmp_path, extra), "cpu", torch.float32)
    assert "\n" not in str(err.value)


def test_generate_runs_it_from_the_command_line(folder, reference, capsys, monkeypatch):
    from outrider.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code = main(["generate", "--model", str(folder), "--json", "--max-new-tokens", "12", "--drafter", "suffix",
                 "w5 w17 w33 w8 w5 w17 w33"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    ids = json.loads(captured.out)["token_ids"]
    out = reference.generate(torch.tensor([[5, 17, 33, 8, 5, 17, 33]]), max_new_tokens=12, do_sample=False,
                             eos_token_id=2, pad_token_id=0)
    assert ids == out[0, 7:].tolist()[: len(ids)]


def test_models_check_names_its_mixture_of_experts(folder, capsys):
    from outrider.cli import main

    code = main(["models", "check", str(folder)])
    line = capsys.readouterr().out.strip()
    assert code == 0 and "Qwen3NextForCausalLM, 4 layers (attention, gated_delta), MoE MLPs in 3 layers " \
                         "(8 experts, top 2, a shared expert)" in line, line


def test_seeded_sampling_through_a_tree_is_the_plain_sample(model, folder):
    """At temperature > 0 with a seed, the walk commits the token plain sampling draws at each
    position: the same text through the MoE layers, drafted or not."""
    requests = [Request(PROMPT, 20, SamplingParams(0.8, seed=11))]
    plain = [f.token_ids for f in generate_ids(model, requests, set())]
    spec = Speculator.build(SpecOptions(f"draft-model:{folder}", "static:2,2", "fixed:3"), model, folder)
    assert [f.token_ids for f in generate_ids(model, requests, set(), speculation=spec)] == plain


@pytest.mark.parametrize("step, dense", [(1, []), (2, []), (3, [2]), (1, [0, 3]), (2, [1])])
def test_which_mlps_are_sparse_is_transformers_rule(step, dense):
    """decoder_sparse_step and mlp_only_layers decide as transformers' own decoder layers do
    (the tiny model above has step 1 and one dense layer: this covers the other steps)."""
    import transformers as tf
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer, Qwen3NextSparseMoeBlock

    from outrider.models.moe_config import qwen_mlp_kinds

    config = tf.Qwen3NextConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=6,
                                num_attention_heads=1, num_key_value_heads=1, head_dim=8, linear_key_head_dim=8,
                                linear_value_head_dim=8, linear_num_key_heads=1, linear_num_value_heads=1,
                                num_experts=2, num_experts_per_tok=1, moe_intermediate_size=4,
                                shared_expert_intermediate_size=4, decoder_sparse_step=step, mlp_only_layers=dense)
    theirs = tuple("moe" if isinstance(Qwen3NextDecoderLayer(config, i).mlp, Qwen3NextSparseMoeBlock) else "dense"
                   for i in range(6))
    assert qwen_mlp_kinds(config.to_dict()) == theirs
    assert qwen_mlp_kinds({**config.to_dict(), "num_experts": 0}) == ("dense",) * 6


def test_without_renormalisation_it_is_still_transformers(folder, tmp_path):
    """norm_topk_prob false (Qwen2-MoE's default): the chosen experts keep their softmax weights."""
    from transformers import AutoModelForCausalLM

    changed = tmp_path / "unnormed"
    shutil.copytree(folder, changed)
    raw = json.loads((changed / "config.json").read_text())
    (changed / "config.json").write_text(json.dumps({**raw, "norm_topk_prob": False}))
    ours = load_decoder(changed, "cpu", torch.float32)
    assert not ours.config.moe.norm_topk_prob
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(str(changed), dtype=torch.float32).eval()(TOKENS[None]).logits[0]
    got = _whole(ours)
    assert torch.allclose(got, want, **CLOSE), (got - want).abs().max()


def test_the_qwen_moe_fields_their_defaults_and_refusals(folder):
    from outrider.models.config import ModelConfig
    from outrider.models.moe_config import MoeConfig, experts_of, qwen_mlp_kinds, qwen_moe

    assert (experts_of({"num_local_experts": 4}), experts_of({"num_experts": 3, "num_local_experts": 4}),
            experts_of({})) == (4, 3, 0)  # num_local_experts: transformers 5's Qwen3MoeConfig writes it
    assert qwen_mlp_kinds({"num_hidden_layers": 3, "num_experts": 1}) == ("moe",) * 3  # no step: every layer
    raw = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8, "shared_expert_intermediate_size": 16}
    assert qwen_moe(raw, shared=False, norm_default=False) == MoeConfig(4, 2, 8, False)
    assert qwen_moe(raw, shared=True, norm_default=True) == MoeConfig(4, 2, 8, True, 16, True)
    assert not qwen_moe({**raw, "norm_topk_prob": False}, shared=True, norm_default=True).norm_topk_prob
    saved = json.loads((folder / "config.json").read_text())
    del saved["norm_topk_prob"]  # Qwen3NextConfig's default: renormalised
    assert ModelConfig.from_dict(saved).moe.norm_topk_prob
    MoeConfig(4, 4, 8, True)  # every expert chosen: runs
    for k in (0, 5):
        with pytest.raises(ModelError, match=f"num_experts_per_tok {k} must be between 1 and num_experts 4"):
            MoeConfig(4, k, 8, True)
    with pytest.raises(ModelError, match=r"a sparsemax router is not supported yet \(supported: softmax, sigmoid\)"):
        MoeConfig(4, 2, 8, True, scoring="sparsemax")  # sigmoid: DeepSeek-V3's (tests/test_deepseek_moe.py)


def _fused(tensors, experts=8, rows=("gate", "up")):
    """Layers 0, 2, 3's experts in transformers' fused layout: the first `experts`, `rows` of each."""
    for i in (0, 2, 3):
        p = f"model.layers.{i}.mlp.experts."
        pop = lambda e, n: tensors.pop(f"{p}{e}.{n}_proj.weight")  # noqa: E731
        gate_up = [torch.cat([pop(e, n) for n in ("gate", "up")]) for e in range(8)]  # [2I, E] each
        down = [pop(e, "down") for e in range(8)]
        keep = torch.cat([torch.arange(32) + 32 * ("gate", "up").index(n) for n in rows])
        tensors[p + "gate_up_proj"] = torch.stack(gate_up[:experts])[:, keep]  # [N, 2I, E]
        tensors[p + "down_proj"] = torch.stack(down[:experts])  # [N, E, I]


@pytest.mark.parametrize("change, says", [
    (lambda t: t.update({"model.layers.0.mlp.gate.weight": t["model.layers.0.mlp.gate.weight"][:7].clone()}),
     r"layers\.0\.mlp\.gate\.weight is \[7, 64\], not \[num_experts 8, hidden_size 64\]"),
    (lambda t: _fused(t, experts=7), r"gate_up_proj is \[7, 64, 64\], not \[num_experts 8, 2 x moe_intermediate_size 32"),
    (lambda t: _fused(t, rows=("gate",)), r"gate_up_proj is \[8, 32, 64\], not \[num_experts 8, 2 x moe_intermediate_size 32"),
], ids=["router-rows", "fused-experts", "fused-rows"])
def test_expert_tensors_of_the_wrong_shape_are_refused_in_one_line(folder, tmp_path, change, says):
    with pytest.raises(ModelError, match=says) as err:
        load_decoder(_rewritten(folder, tmp_path, change), "cpu", torch.float32)
    assert "\n" not in str(err.value)
