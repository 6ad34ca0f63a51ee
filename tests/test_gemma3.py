"""Gemma 3 (models/gemma3.py) against transformers' own implementation: a small random
`Gemma3ForCausalLM` with sliding-window layers (window 6, so a 40-token prompt crosses it) beside a
global one, its own RoPE base on each, an attention scale other than head_dim ** -0.5 and random
(1 + w) norms, gives transformers' logits (a whole prefill, a chunked one, decode steps) and greedy
tokens; greedy speculation on it equals plain decoding with a lookup chain and with trees deeper
than the window (the window's edge inside a draft: a node's earliest ancestors fall out of it);
and the checks fail when the window is off by one, the RoPE bases are swapped or a sandwich norm
is dropped."""

from __future__ import annotations

import pytest
import torch

from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.errors import ModelError
from outrider.models import sliding
from outrider.models.batch import pack
from outrider.models.config import ModelConfig
from outrider.sampling import SamplingParams
from outrider.weights.loader import load_decoder
from tiny import add_tokenizer, logits_in_steps

WINDOW = 6
TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
TOKENS = torch.randint(3, 96, (40,), generator=torch.Generator().manual_seed(1))
PROMPT = [5, 17, 33, 8, 5, 17, 33, 9, 40, 41, 42, 43, 44, 5, 17, 33, 8, 5, 17]


def save(folder):
    import transformers as tf

    config = tf.Gemma3TextConfig(
        vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, sliding_window=WINDOW, layer_types=TYPES, max_position_embeddings=256,
        query_pre_attn_scalar=20, rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                         "full_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    torch.manual_seed(1)
    model = tf.Gemma3ForCausalLM(config).eval()
    with torch.no_grad():  # the norms' weights are zeros at init: random, so that (1 + w) is read
        for p in model.parameters():
            if p.dim() == 1:
                p.normal_(0, 0.5)
    model.save_pretrained(folder)
    add_tokenizer(folder)
    return model


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma3")
    reference = save(folder)
    with torch.no_grad():
        want = reference(TOKENS[None]).logits[0]  # [40, vocab]
    return folder, reference, want, load_decoder(folder, "cpu", torch.float32)



def test_config_reads_windows_ropes_and_scale(pair):
    model = pair[3]
    c = model.config
    assert c.layer_windows == (WINDOW, WINDOW, 0, WINDOW) and c.attn_scale == pytest.approx(20 ** -0.5)
    assert (c.rope.theta, c.rope_local.theta) == (10000.0, 100.0)
    assert c.sandwich_norms and c.embed_scale and c.activation == "gelu_tanh" and not c.plain_block


@pytest.mark.parametrize("cuts", [[0, 40], [0, 13, 30, 40], [0, 30, *range(31, 41)]],
                         ids=["whole", "chunked", "decode"])
def test_logits_match_transformers(pair, cuts):
    got = logits_in_steps(pair[3], TOKENS, cuts)
    want = pair[2]
    assert torch.allclose(got, want, atol=2e-5, rtol=1e-4), (got - want).abs().max()


def test_greedy_tokens_match_transformers(pair):
    reference, model = pair[1], pair[3]
    out = reference.generate(torch.tensor([PROMPT]), max_new_tokens=40, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    plain = generate_ids(model, [Request(PROMPT, 40, SamplingParams(0.0))], set())[0].token_ids
    assert plain == out[0, len(PROMPT):].tolist()
    assert len(set(plain)) > 10  # not a repeated token: the window changes what the model says


@pytest.mark.parametrize("drafter, tree, control", [
    ("suffix", "chain", "fixed:8"),
    ("draft-model", "static:2,2,1,1,1,1,1,1", "fixed:8"),  # the model drafts itself: 8 deep, past the window
    ("early-exit:2", "static:2,2,1", "fixed:3"),
])
def test_speculation_is_exact(pair, drafter, tree, control):
    folder, model = pair[0], pair[3]
    requests = [Request(PROMPT, 40, SamplingParams(0.0)), Request(PROMPT[3:] + [60, 61], 33, SamplingParams(0.0))]
    plain = [c.token_ids for c in generate_ids(model, requests, set())]
    name = f"draft-model:{folder}" if drafter == "draft-model" else drafter
    speculator = Speculator.build(SpecOptions(name, tree, control), model, folder)
    done = generate_ids(model, requests, set(), speculation=speculator)
    assert [c.token_ids for c in done] == plain
    if drafter == "draft-model":  # its drafts were accepted whole: past the window's edge
        assert done[0].stats["mean_accepted_length"] > WINDOW


def _off_by_one(keys, queries, window):  # the window's rule, in the rings' masks and the full cache's
    return _IN_WINDOW(keys, queries, window + 1)


_IN_WINDOW = sliding.in_window


@pytest.mark.parametrize("mutant", ["window off by one", "RoPE bases swapped", "no norm after attention",
                                    "no norm after the MLP"])
def test_the_checks_catch(pair, mutant, monkeypatch):
    folder, want = pair[0], pair[2]
    model = load_decoder(folder, "cpu", torch.float32)
    if mutant == "window off by one":
        monkeypatch.setattr(sliding, "in_window", _off_by_one)
    elif mutant == "RoPE bases swapped":
        model.inv_freq, model.inv_freq_local = model.inv_freq_local, model.inv_freq
    else:
        ones = torch.ones(64)
        for w in model.layers:
            if mutant == "no norm after attention":
                w.attn_out_norm = ones
            else:
                w.mlp_out_norm = ones
        model.layers = [w for w in model.layers]
    got = logits_in_steps(model, TOKENS, [0, 13, 30, 40])
    assert not torch.allclose(got, want, atol=2e-5, rtol=1e-4)


def test_soft_capping_and_other_activations_are_refused(pair):
    import json

    raw = json.loads((pair[0] / "config.json").read_text())
    for field, value, why in (("final_logit_softcapping", 30.0, "logit soft-capping"),
                              ("attn_logit_softcapping", 50.0, "attention logit soft-capping"),
                              ("hidden_activation", "relu", "GELU-tanh"),
                              ("use_bidirectional_attention", True, "bidirectional attention")):
        with pytest.raises(ModelError, match=why) as err:
            ModelConfig.from_dict({**raw, field: value})
        assert "\n" not in str(err.value)


def test_slots_out_of_order_with_trees_see_their_own_windows(pair):
    """Two slots, given out of order with a hole between them (span rows), each verifying a tree
    deeper than the window after a prompt longer than it: each row's logits equal that slot's alone."""
    model = pair[3]
    prompts = {2: TOKENS[:20], 0: TOKENS[5:36]}
    parents = torch.tensor([-1, 0, 0, 1, 3, 4, 5, 6, 7])  # 8 deep past the root's sibling: past the window
    drafts = {2: TOKENS[20:29], 0: TOKENS[30:39]}
    alone = {}
    for slot in prompts:
        cache = model.new_cache(3, 64)
        model.forward(pack([slot], [0], [prompts[slot]], logits="none", scratch_row=cache.scratch_row), cache)
        cache.set_length(slot, len(prompts[slot]))
        alone[slot] = model.forward(pack([slot], [len(prompts[slot])], [drafts[slot]], [parents],
                                         scratch_row=cache.scratch_row), cache).logits[0]
    cache = model.new_cache(3, 64)
    for slot in prompts:
        model.forward(pack([slot], [0], [prompts[slot]], logits="none", scratch_row=cache.scratch_row), cache)
        cache.set_length(slot, len(prompts[slot]))
    both = model.forward(pack([2, 0], [20, 31], [drafts[2], drafts[0]], [parents, parents],
                              scratch_row=cache.scratch_row), cache).logits
    for row, slot in enumerate((2, 0)):
        assert torch.allclose(both[row], alone[slot], atol=2e-5, rtol=1e-4), (both[row] - alone[slot]).abs().max()


def test_transformers_4_config_form(pair):
    """A hub config as transformers 4 wrote it: rope_theta and rope_local_base_freq, no layer_types
    (every sliding_window_pattern-th layer global), no rope_parameters."""
    import json

    raw = json.loads((pair[0] / "config.json").read_text())
    for field in ("layer_types", "rope_parameters"):
        raw.pop(field)
    c = ModelConfig.from_dict({**raw, "num_hidden_layers": 6, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                               "sliding_window_pattern": 3, "rope_scaling": None})
    assert c.layer_windows == (WINDOW, WINDOW, 0, WINDOW, WINDOW, 0)
    assert (c.rope.theta, c.rope_local.theta) == (1e6, 1e4)
