"""A float16 K/V cache (`--kv-dtype float16`, llama.cpp's default cache type): half the bytes, the
native layer (attention.c) and the torch layer store the same rounding, and every drafter's greedy
output still equals the model's own greedy output with it."""

import pytest
import torch

from kernel_variants import TWO, variant  # noqa: F401  (variant: the fixture)

pytestmark = pytest.mark.model

PROMPTS = ["Monday, Tuesday, Wednesday,", "def fibonacci(n):\n    "]


@pytest.fixture(scope="module")
def q4_kv16(smollm2_path):
    from outrider.weights.loader import load_decoder

    model = load_decoder(smollm2_path, "cpu", "q4")
    model.kv_dtype = torch.float16
    return model


def logits(model, tokens: list[int]) -> torch.Tensor:
    from outrider.models.batch import pack

    cache = model.new_cache(1, len(tokens) + 1)
    return model.forward(pack([0], [0], [torch.tensor(tokens)], logits="all", scratch_row=cache.scratch_row),
                         cache).logits[0]


def test_the_cache_is_float16_and_half_the_bytes(q4_kv16, smollm2_path):
    from outrider.weights.loader import load_decoder

    half, full = q4_kv16.new_cache(2, 100), load_decoder(smollm2_path, "cpu", "q4").new_cache(2, 100)
    assert half.k[0].dtype == torch.float16 and full.k[0].dtype == torch.float32
    assert 2 * half.k[0].numel() * half.k[0].element_size() == full.k[0].numel() * full.k[0].element_size()


@pytest.mark.parametrize("variant", TWO, indirect=True)
def test_native_and_torch_layers_agree(q4_kv16, runtime, smollm2_path, smollm2_tokenizer, variant):
    """Both round K/V to nearest even; they differ as their float32 arithmetic differs (a K value
    one float16 step apart where float32 rounding moves it across a boundary: measured 0.015 of
    logits up to ~30, against 8e-5 with a float32 cache), so: close, and the same argmax. On the
    default variant of the C kernels and the portable one (its own float16 conversions)."""
    from outrider.weights.loader import load_decoder

    tokens = smollm2_tokenizer("The quick brown fox jumps over the lazy dog. The quick")["input_ids"]
    native = logits(q4_kv16, tokens)
    runtime(native_layer=False)  # read at a model's first forward
    reference = load_decoder(smollm2_path, "cpu", "q4")
    reference.kv_dtype = torch.float16
    torch_layers = logits(reference, tokens)
    assert reference._native is None and q4_kv16._native is not None
    assert (native - torch_layers).abs().max() < 0.1
    assert torch.equal(native.argmax(-1), torch_layers.argmax(-1))


@pytest.fixture(scope="module")
def plain_outputs() -> dict[str, list[list[int]]]:
    """The float16-cache model's greedy output on PROMPTS without drafts: worked out by the first
    case, read by the others (it does not depend on the drafter)."""
    return {}


@pytest.mark.parametrize("drafter,tree", [("ngram", "chain"), ("suffix", "chain"), ("early-exit:8", "static:2,1,1"),
                                          ("eagle3:smollm2-135m-instruct", "dynamic:3,6"),
                                          ("draft-model:smollm2-135m-instruct@q4_0", "chain")])
def test_speculative_greedy_equals_autoregressive(q4_kv16, smollm2_path, smollm2_tokenizer, plain_outputs, drafter,
                                                  tree):
    from outrider.engine.generate import generate_ids
    from outrider.engine.request import Request
    from outrider.engine.speculator import SpecOptions, Speculator

    spec = Speculator.build(SpecOptions(drafter, tree, "fixed:4"), q4_kv16, smollm2_path)
    if drafter.startswith("draft-model"):  # the drafter's own cache follows the target's type
        assert spec.drafter.decoder.kv_dtype == torch.float16
    requests = lambda: [Request(smollm2_tokenizer(p)["input_ids"], 16) for p in PROMPTS]  # noqa: E731
    if "plain" not in plain_outputs:
        plain_outputs["plain"] = [f.token_ids for f in generate_ids(q4_kv16, requests(), set())]
    plain = plain_outputs["plain"]
    outs = generate_ids(q4_kv16, requests(), set(), speculation=spec)
    assert [f.token_ids for f in outs] == plain
    assert sum(f.round_stats.committed for f in outs) > sum(f.round_stats.rounds for f in outs)  # drafts were accepted


def test_a_bad_kv_dtype_is_one_line(capsys):
    from outrider.cli import main

    assert main(["generate", "--kv-dtype", "int4", "hi"]) != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "float16" in err and len(err.splitlines()) == 1
