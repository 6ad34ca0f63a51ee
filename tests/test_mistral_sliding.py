"""Mistral's sliding window on every layer (models/mistral.py, models/sliding.py) against
transformers' own: a small random MistralForCausalLM with sliding_window 6 gives transformers'
logits over a 40-token prompt (whole, chunked, decode steps) and its greedy tokens; greedy
speculation equals plain decoding with a suffix chain and with the model drafting itself in a tree
8 deep (the window's edge inside a draft); a Qwen2 with use_sliding_window on its upper layers gives
transformers' logits too; and the checks fail when the window is off by one or ignored."""

from __future__ import annotations

import pytest
import torch

from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.models import sliding
from outrider.models.config import ModelConfig
from outrider.sampling import SamplingParams
from outrider.weights.loader import load_decoder
from tiny import add_tokenizer, logits_in_steps

WINDOW = 6
TOKENS = torch.randint(3, 96, (40,), generator=torch.Generator().manual_seed(3))
PROMPT = [5, 17, 33, 8, 5, 17, 33, 9, 40, 41, 42, 43, 44, 5, 17, 33, 8, 5, 17, 50, 51, 52]
SIZES = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, sliding_window=WINDOW, bos_token_id=1,
             eos_token_id=2, pad_token_id=0)


def save(folder, family: str):
    import transformers as tf

    if family == "mistral":
        config, cls = tf.MistralConfig(**SIZES), tf.MistralForCausalLM
    else:  # layer 0 global, layer 1 windowed (max_window_layers 1)
        config, cls = tf.Qwen2Config(**SIZES, use_sliding_window=True, max_window_layers=1), tf.Qwen2ForCausalLM
    torch.manual_seed(4)
    model = cls(config).eval()
    with torch.no_grad():  # sharper attention: the keys a window drops matter
        for p in model.parameters():
            p.mul_(4.0 if p.dim() > 1 else 1.0)
    model.save_pretrained(folder)
    add_tokenizer(folder)
    with torch.no_grad():
        want = model(TOKENS[None]).logits[0]  # [40, vocab]
    return model, want


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mistral")
    reference, want = save(folder, "mistral")
    return folder, reference, want, load_decoder(folder, "cpu", torch.float32)



def close(got, want) -> bool:
    return torch.allclose(got, want, atol=2e-5, rtol=1e-4)


def test_config_reads_the_window(mistral):
    c = mistral[3].config
    assert c.layer_windows == (WINDOW, WINDOW) and not c.plain_block
    raw = {"architectures": ["MistralForCausalLM"], **SIZES}
    assert ModelConfig.from_dict({**raw, "sliding_window": None}).plain_block  # v0.2 and later: Llama's block
    assert ModelConfig.from_dict({**raw, "sliding_window": 256}).plain_block  # as long as the context


@pytest.mark.parametrize("cuts", [[0, 40], [0, 13, 30, 40], [0, 30, *range(31, 41)]],
                         ids=["whole", "chunked", "decode"])
def test_logits_match_transformers(mistral, cuts):
    got = logits_in_steps(mistral[3], TOKENS, cuts)
    assert close(got, mistral[2]), (got - mistral[2]).abs().max()


def test_greedy_tokens_match_transformers(mistral):
    reference, model = mistral[1], mistral[3]
    out = reference.generate(torch.tensor([PROMPT]), max_new_tokens=30, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    plain = generate_ids(model, [Request(PROMPT, 30, SamplingParams(0.0))], set())[0].token_ids
    assert plain == out[0, len(PROMPT):].tolist()


@pytest.mark.parametrize("drafter, tree, control", [
    ("suffix", "chain", "fixed:8"),
    ("draft-model", "static:2,2,1,1,1,1,1,1", "fixed:8"),  # the model drafts itself: 8 deep, past the window
])
def test_speculation_is_exact(mistral, drafter, tree, control):
    folder, model = mistral[0], mistral[3]
    requests = [Request(PROMPT, 30, SamplingParams(0.0)), Request(PROMPT[3:] + [60, 61], 25, SamplingParams(0.0))]
    plain = [c.token_ids for c in generate_ids(model, requests, set())]
    name = f"draft-model:{folder}" if drafter == "draft-model" else drafter
    speculator = Speculator.build(SpecOptions(name, tree, control), model, folder)
    done = generate_ids(model, requests, set(), speculation=speculator)
    assert [c.token_ids for c in done] == plain
    if drafter == "draft-model":  # its drafts were accepted whole: past the window's edge
        assert done[0].stats["mean_accepted_length"] > WINDOW


@pytest.mark.parametrize("mutant", ["window off by one", "window ignored"])
def test_the_checks_catch(mistral, mutant, monkeypatch):
    model = load_decoder(mistral[0], "cpu", torch.float32)
    real = sliding.in_window  # the window's rule, in the rings' masks and the full cache's
    if mutant == "window off by one":
        monkeypatch.setattr(sliding, "in_window", lambda keys, queries, window: real(keys, queries, window + 1))
    else:
        monkeypatch.setattr(sliding, "in_window", lambda keys, queries, window: real(keys, queries, 1 << 20))
    assert not close(logits_in_steps(model, TOKENS, [0, 13, 30, 40]), mistral[2])


def test_qwen2_sliding_layers_match_transformers(tmp_path):
    _, want = save(tmp_path, "qwen2")
    model = load_decoder(tmp_path, "cpu", torch.float32)
    assert model.config.layer_windows == (0, WINDOW)
    got = logits_in_steps(model, TOKENS, [0, 13, 30, 40])
    assert close(got, want), (got - want).abs().max()
