"""Our runtime against transformers' modeling code (the reference) on tiny random models."""

import pytest
import torch

from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.models.batch import pack
from outrider.weights.loader import load_decoder
from tiny import reference

KINDS = ["llama", "qwen2", "qwen3", "llama-tied"]


def run_all(decoder, tokens, hidden_layers=()):
    cache = decoder.new_cache(1, 64)
    batch = pack([0], [0], [tokens], hidden_layers=hidden_layers, scratch_row=cache.scratch_row)
    return decoder.forward(batch, cache)


@pytest.mark.parametrize("kind", KINDS)
def test_logits_and_hidden_states_match_transformers(tiny_folders, kind):
    ref = reference(tiny_folders[kind])
    ours = load_decoder(tiny_folders[kind], "cpu")
    tokens = torch.randint(0, 96, (13,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ref(tokens[None], output_hidden_states=True)
    out = run_all(ours, tokens, hidden_layers=(0, 1, 3))
    torch.testing.assert_close(out.logits[0], expected.logits[0], atol=1e-4, rtol=1e-4)
    for layer in (0, 1):  # the last entry of HF's tuple is after the final norm, ours is before it
        torch.testing.assert_close(out.hidden[layer][0], expected.hidden_states[layer][0], atol=1e-4, rtol=1e-4)
    assert out.hidden[3].shape == (1, 13, 64)
    assert expected.logits[0].std() > 0.1  # the comparison is not between two flat outputs


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_generation_matches_transformers(tiny_folders, kind):
    ref = reference(tiny_folders[kind])
    ours = load_decoder(tiny_folders[kind], "cpu")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (1, 2, 5, 9, 17)]
    outs = generate_ids(ours, [Request(p, 24) for p in prompts], eos_ids=set())
    for prompt, out in zip(prompts, outs):
        expected = ref.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert out.token_ids == expected
        assert out.finish_reason == "length"


def test_eos_stops_and_truncates(tiny_folders):
    ours = load_decoder(tiny_folders["llama"], "cpu")
    full = generate_ids(ours, [Request([5, 6, 7], 20)], eos_ids=set())[0].token_ids
    eos = full[7]
    first = full.index(eos)
    out = generate_ids(ours, [Request([5, 6, 7], 20)], eos_ids={eos})[0]
    assert out.token_ids == full[: first + 1]
    assert out.finish_reason == "eos"
