"""Integration on the packaged SmolLM2-135M (pulled by `make test`): our runtime against
transformers' modeling code on the same folder, and speculative greedy against plain greedy.

A decode step of this model reads about 540 MB of float32 weights, so each test is kept to a
few seconds of CPU: few prompts, few tokens, and the model loaded once per test process (the
session fixtures in conftest.py)."""

import pytest
import torch

pytestmark = pytest.mark.model

PROMPTS = ["def is_palindrome(s: str) -> bool:\n", "The three primary colours are"]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]  # answered in ~8 tokens

# Within SPEC_TOKENS every drafter below has drafts accepted on one of these prompts at least (the
# early-exit drafter on the weekdays, the n-gram and suffix lookups on the count) and others rejected.
SPEC_PROMPTS = ["Monday, Tuesday, Wednesday,", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"]
SPEC_TOKENS = 10


def test_logits_match_transformers(smollm2_decoder, smollm2_tokenizer, smollm2_transformers):
    from outrider.models.batch import pack

    ids = torch.tensor(smollm2_tokenizer(PROMPTS[0] + PROMPTS[1])["input_ids"])
    with torch.no_grad():
        expected = smollm2_transformers(ids[None]).logits[0]
    cache = smollm2_decoder.new_cache(1, 128)
    got = smollm2_decoder.forward(pack([0], [0], [ids], scratch_row=cache.scratch_row), cache).logits[0]
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=1e-3)


def test_greedy_matches_transformers(smollm2_path, smollm2_decoder, smollm2_tokenizer, smollm2_transformers):
    """Our runtime decodes the prompts as one ragged batch; transformers' generate takes each alone.
    Both stop at the model's end-of-generation tokens: the chat turn ends early on <|im_end|>."""
    from outrider.weights.tokenizer import eos_ids_of
    from outrider.engine.generate import generate_ids
    from outrider.engine.request import Request

    tok, max_new = smollm2_tokenizer, 16
    eos = eos_ids_of(smollm2_path, tok)
    chat = tok.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=True)["input_ids"]
    prompts = [tok(p)["input_ids"] for p in PROMPTS] + [list(chat)]
    got = [f.token_ids for f in generate_ids(smollm2_decoder, [Request(ids, max_new) for ids in prompts], eos)]
    for ids, out in zip(prompts, got):
        with torch.no_grad():
            expected = smollm2_transformers.generate(torch.tensor([ids]), max_new_tokens=max_new,
                                                     do_sample=False)[0, len(ids):].tolist()
        assert out == expected, tok.decode(ids)
    assert len(got[-1]) < max_new and got[-1][-1] in eos  # the early stop was exercised


@pytest.fixture(scope="module")
def spec_prompts(smollm2_tokenizer) -> list[list[int]]:
    return [smollm2_tokenizer(p)["input_ids"] for p in SPEC_PROMPTS]


@pytest.fixture(scope="module")
def plain(smollm2_decoder, spec_prompts) -> list[list[int]]:
    """Greedy autoregressive outputs of SPEC_PROMPTS, computed once for every drafter and tree."""
    from outrider.engine.generate import generate_ids
    from outrider.engine.request import Request

    return [f.token_ids for f in generate_ids(smollm2_decoder, [Request(p, SPEC_TOKENS) for p in spec_prompts], set())]


@pytest.mark.parametrize("drafter,tree", [("ngram", "chain"), ("suffix", "chain"), ("early-exit:8", "chain"),
                                          ("early-exit:8", "static:2,2,1"), ("early-exit:8", "dynamic:3,8")])
def test_speculative_greedy_equals_autoregressive(smollm2_path, smollm2_decoder, spec_prompts, plain, drafter, tree):
    from outrider.engine.generate import generate_ids
    from outrider.engine.request import Request
    from outrider.engine.speculator import SpecOptions, Speculator

    spec = Speculator.build(SpecOptions(drafter, tree, "fixed:4"), smollm2_decoder, smollm2_path)
    fast = generate_ids(smollm2_decoder, [Request(p, SPEC_TOKENS) for p in spec_prompts], set(), speculation=spec)
    assert [f.token_ids for f in fast] == plain
    assert sum(f.round_stats.committed for f in fast) > sum(f.round_stats.rounds for f in fast)  # something was accepted
