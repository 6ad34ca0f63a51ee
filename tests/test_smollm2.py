"""Integration on the packaged SmolLM2-135M (pulled by `make test`): our runtime against
transformers' modeling code on the same folder, and speculative greedy against plain greedy."""

import pytest
import torch

from outrider.errors import ModelError

pytestmark = pytest.mark.model

PROMPTS = [
    "def is_palindrome(s: str) -> bool:\n",
    "The three primary colours are",
    "import os\n\nfor root, dirs, files in os.walk('.'):\n",
    "Q: What is the capital of France?\nA:",
    "class Point:\n    def __init__(self, x, y):\n",
]


@pytest.fixture(scope="module")
def smol():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from outrider.models.catalog import resolve_model
    from outrider.models.loader import load_decoder

    try:
        path = resolve_model("smollm2-135m-instruct")
    except ModelError as err:
        pytest.fail(f"{err} (or deselect with -m 'not model')")
    ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return load_decoder(path, "cpu", torch.float32), ref, AutoTokenizer.from_pretrained(str(path))


def test_logits_match_transformers(smol):
    from outrider.models.batch import pack

    ours, ref, tok = smol
    ids = torch.tensor(tok(PROMPTS[0] + PROMPTS[1])["input_ids"])
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
    cache = ours.new_cache(1, 128)
    got = ours.forward(pack([0], [0], [ids], scratch_row=cache.scratch_row), cache).logits[0]
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=1e-3)


def test_greedy_matches_transformers_on_five_prompts(smol):
    """Both stop at the model's end-of-generation tokens (one prompt ends early on <|im_end|>)."""
    from outrider.engine import eos_ids_of
    from outrider.generation import Request, generate_ids
    from outrider.models.catalog import resolve_model

    ours, ref, tok = smol
    eos = eos_ids_of(resolve_model("smollm2-135m-instruct"), tok)
    for prompt in PROMPTS:
        ids = tok(prompt)["input_ids"]
        got = generate_ids(ours, [Request(ids, 24)], eos)[0].output_ids
        with torch.no_grad():
            expected = ref.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
        assert got == expected, prompt


@pytest.mark.parametrize("drafter,tree", [("ngram", "chain"), ("suffix", "chain"), ("early-exit:8", "chain"),
                                          ("early-exit:8", "static:2,2,1"), ("early-exit:8", "dynamic:3,8")])
def test_speculative_greedy_equals_autoregressive(smol, drafter, tree):
    from outrider.generation import Request, generate_ids
    from outrider.models.catalog import resolve_model
    from outrider.spec.speculator import SpecOptions, Speculator

    ours, _, tok = smol
    spec = Speculator.build(SpecOptions(drafter, tree, "fixed:4"), ours, resolve_model("smollm2-135m-instruct"))
    requests = [Request(tok(p)["input_ids"], 32) for p in PROMPTS[:3]]
    plain = [f.output_ids for f in generate_ids(ours, requests, set())]
    fast = generate_ids(ours, requests, set(), speculation=spec)
    assert [f.output_ids for f in fast] == plain
    assert sum(f.stats.committed for f in fast) > sum(f.stats.rounds for f in fast)  # something was accepted
