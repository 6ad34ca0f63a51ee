"""A gated-delta hybrid (the Qwen3.5 layout: gated-delta layers and gated attention every fourth)
against transformers' own implementation, and speculation on it: every drafter that runs on a
target, chains and trees, greedy output equal to plain decoding; a state that refuses to be cut
back. The recurrence's algebra (TreeWY) is tests/test_gated_delta.py's."""

from __future__ import annotations

import json

import pytest
import torch

from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.errors import ModelError
from outrider.models.batch import pack
from outrider.models.state import HybridState
from outrider.sampling import SamplingParams
from outrider.weights.loader import load_decoder
from tiny import add_tokenizer, make_tiny

PROMPT = [5, 17, 33, 8, 5, 17, 33, 9, 40, 41]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = make_tiny("qwen3_5", tmp_path_factory.mktemp("hybrid") / "qwen3_5", layers=4)
    add_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def reference(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def model(folder):
    return load_decoder(folder, "cpu", torch.float32)


def test_the_layers_are_read_as_a_hybrid(model):
    c = model.config
    assert c.layer_kinds == ("gated_delta", "gated_delta", "gated_delta", "attention")
    assert c.rotary_dim == 8 and c.attn_output_gate and c.norm_plus_one and c.delta.conv_kernel == 4
    assert isinstance(model.new_cache(1, 8), HybridState)


def test_logits_match_transformers_whole_chunked_and_stepwise(model, reference):
    tokens = torch.tensor([3, 9, 4, 11, 7, 8, 20, 5, 3, 9, 60, 61, 62, 63, 12, 30, 31, 2, 9, 4])
    with torch.no_grad():
        want = reference(tokens[None]).logits[0]  # [T, vocab]
    cache = model.new_cache(1, 32)
    whole = model.forward(pack([0], [0], [tokens], scratch_row=cache.scratch_row), cache).logits[0]
    assert torch.allclose(whole, want, atol=2e-5, rtol=1e-4), (whole - want).abs().max()
    # a prefill in chunks (folded as it goes), then one token a step (held, then committed)
    cache = model.new_cache(1, 32)
    for start, stop in ((0, 5), (5, 12)):
        model.forward(pack([0], [start], [tokens[start:stop]], logits="none", scratch_row=cache.scratch_row), cache)
        cache.set_length(0, stop)
    steps = []
    for i in range(12, len(tokens)):
        steps.append(model.forward(pack([0], [i], [tokens[i:i + 1]], scratch_row=cache.scratch_row), cache).logits[0, 0])
        cache.set_length(0, i + 1)
    got = torch.stack(steps)
    assert torch.allclose(got, want[12:], atol=2e-5, rtol=1e-4), (got - want[12:]).abs().max()


def test_greedy_generation_matches_transformers(model, reference):
    out = reference.generate(torch.tensor([PROMPT]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    ours = generate_ids(model, [Request(PROMPT, 24, SamplingParams(0.0))], set())[0].token_ids
    assert ours == out[0, len(PROMPT):].tolist()


SPECS = [("ngram", "chain"), ("suffix", "chain"), ("draft-model:{folder}", "chain"),
         ("draft-model:{folder}", "static:2,2,1"), ("draft-model:{folder}", "dynamic:4,8"),
         ("early-exit:2", "chain"), ("early-exit:2", "static:2,2")]


@pytest.mark.parametrize("drafter, tree", SPECS, ids=[f"{d.split(':')[0]}-{t}" for d, t in SPECS])
def test_greedy_speculation_equals_plain_decoding(model, folder, drafter, tree):
    """The model drafting for itself accepts most drafts, so commits run deep into trees."""
    requests = [Request(PROMPT, 24, SamplingParams(0.0)), Request(PROMPT[::-1], 20, SamplingParams(0.0))]
    plain = [f.token_ids for f in generate_ids(model, requests, set())]
    spec = Speculator.build(SpecOptions(drafter.format(folder=folder), tree, "fixed:4"), model, folder)
    fast = generate_ids(model, requests, set(), speculation=spec)
    assert [f.finish_reason for f in fast] == ["length", "length"], [f.error for f in fast]
    assert [f.token_ids for f in fast] == plain
    if drafter.startswith("draft-model"):
        assert fast[0].stats["mean_accepted_length"] > 2.5  # trees really committed deep paths


def test_seeded_sampling_through_a_tree_is_the_plain_sample(model, folder):
    """At temperature > 0 with a seed, a tree's walk commits the token plain sampling draws at each
    position: the same text, drafted or not."""
    params = SamplingParams(0.8, seed=11)
    requests = [Request(PROMPT, 20, params)]
    plain = [f.token_ids for f in generate_ids(model, requests, set())]
    spec = Speculator.build(SpecOptions(f"draft-model:{folder}", "static:2,2", "fixed:3"), model, folder)
    assert [f.token_ids for f in generate_ids(model, requests, set(), speculation=spec)] == plain


def test_a_recurrent_state_is_not_cut_back(model):
    cache = model.new_cache(1, 32)
    model.forward(pack([0], [0], [torch.tensor(PROMPT)], logits="none", scratch_row=cache.scratch_row), cache)
    cache.set_length(0, len(PROMPT))
    with pytest.raises(ModelError, match="cannot be cut back to 4"):
        cache.set_length(0, 4)
    assert not cache.can_copy_prefix(0, 4) and cache.can_copy_prefix(0, len(PROMPT))
    cache.set_length(0, 0)  # emptied: a new sequence
    assert cache.delta.committed[0] == 0


def test_drafters_that_need_k_v_rows_refuse_it(model, folder):
    from outrider.errors import ConfigError

    with pytest.raises(ConfigError, match="gated-delta"):
        Speculator.build(SpecOptions("sparsespec:128", "chain", "fixed:2"), model, folder)


def test_generate_runs_it_from_the_command_line(folder, reference, capsys, monkeypatch):
    """The CLI's whole path (arguments, loading, speculation, --json) in this process: a fresh
    interpreter would only add an import of torch (families are registered statically,
    models/families.py), and tests/test_config_fields.py runs `python -m outrider.cli` itself."""
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


def test_a_draft_models_state_grows_its_slots_for_a_larger_batch(model, folder):
    """Five sequences: the drafter's own state (four slots at first) doubles, every slot kept."""
    requests = [Request([3 + i, 9, 4 + i, 11, 7], 10, SamplingParams(0.0)) for i in range(5)]
    plain = [f.token_ids for f in generate_ids(model, requests, set())]
    spec = Speculator.build(SpecOptions(f"draft-model:{folder}", "chain", "fixed:3"), model, folder)
    fast = generate_ids(model, requests, set(), speculation=spec)
    assert [f.token_ids for f in fast] == plain
    assert spec.drafter.slots.cache.num_slots == 8


def test_weights_kept_quantized_are_the_dequantized_model(folder):
    """--dtype q8_0: every projection (q_proj's query and gate rows apart) in GGUF blocks, multiplied
    by the native kernel: the float model with the blocks' values up to float rounding."""
    from outrider.kernels.blocks import dequantize, quantize

    quantized = load_decoder(folder, "cpu", "q8_0")
    floats = load_decoder(folder, "cpu", torch.float32)
    dq = lambda w: w if w.shape[1] % 32 else dequantize(quantize(w, "q8_0")).float()  # noqa: E731  (as the loader)
    for w in floats.layers:
        for name in ("qkv", "o", "gate", "gate_up", "down"):
            if getattr(w, name) is not None:
                setattr(w, name, dq(getattr(w, name)))
        if w.delta is not None:
            w.delta.in_proj, w.delta.out = dq(w.delta.in_proj), dq(w.delta.out)
    floats.lm_head, floats.embed = dq(floats.lm_head), dq(floats.embed)
    tokens = torch.tensor(PROMPT)
    got = quantized.forward(pack([0], [0], [tokens], scratch_row=32), quantized.new_cache(1, 32)).logits
    want = floats.forward(pack([0], [0], [tokens], scratch_row=32), floats.new_cache(1, 32)).logits
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()


@pytest.mark.parametrize("drafter, tree", [("suffix", "chain"), ("early-exit:2", "static:2,2")])
def test_greedy_speculation_on_a_quantized_hybrid_equals_plain(folder, drafter, tree):
    model = load_decoder(folder, "cpu", "q4")
    requests = [Request(PROMPT, 20, SamplingParams(0.0))]
    plain = [f.token_ids for f in generate_ids(model, requests, set())]
    spec = Speculator.build(SpecOptions(drafter, tree, "fixed:3"), model, folder)
    assert [f.token_ids for f in generate_ids(model, requests, set(), speculation=spec)] == plain
