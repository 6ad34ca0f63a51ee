"""Logits processing that defines the target distribution (issue 25 item 2): logit bias, min-p,
the repetition, presence and frequency penalties, stop token ids, logprobs, prompt logprobs and
a shared prefill. Each is applied identically in plain decoding and in verification (along each
draft node's own path), so greedy speculative output equals greedy plain output with it on."""

from __future__ import annotations

import pytest
import torch

from enumerate_law import one_thread
from tiny import make_tiny

from outrider.control.controllers import FixedController
from outrider.drafters.model import ModelDrafter
from outrider.drafters.ngram import NgramDrafter
from outrider.engine.generate import generate_ids
from outrider.engine.loop import EngineLoop
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.errors import ConfigError
from outrider.sampling import SamplingParams, warp_probs
from outrider.spec.processing import PathProcessor, processed_reference
from outrider.spec.shapes import parse_shape
from outrider.weights.loader import load_decoder

PROMPTS = [[3, 4, 5, 3, 4, 5, 3, 4], [10, 11, 12, 13, 10, 11, 12], [7, 7, 8, 9, 7, 7, 8]]
PROCESSING = {
    "logit_bias": SamplingParams(logit_bias={5: -100.0, 12: 2.0, 40: 3.0}),
    "repetition": SamplingParams(repetition_penalty=1.8),
    "presence": SamplingParams(presence_penalty=1.5),
    "frequency": SamplingParams(frequency_penalty=0.9),
    "all": SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4,
                          logit_bias={4: -3.0, 20: 2.0}),
}


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load_decoder(make_tiny("llama", tmp_path_factory.mktemp("proc") / "t", vocab=96, seed=1), "cpu")


def speculators(target):
    """Drafters that make chains and trees (non-contiguous accepted paths included): n-grams, and
    the target drafting for itself without the processing (its drafts are the unprocessed
    continuation: accepted where the processing keeps the choice, rejected where it changes it)."""
    yield "ngram", Speculator(SpecOptions("ngram", "chain", "fixed:4"), NgramDrafter(), FixedController(4),
                              parse_shape("chain"))
    for shape in ("chain", "static:2,2,1", "dynamic:3,6"):
        yield f"self {shape}", Speculator(
            SpecOptions("draft-model:self", shape, "fixed:4"),
            ModelDrafter(target, parse_shape(shape), name="draft-model:self"), FixedController(4),
            parse_shape(shape))


def test_path_processing_matches_the_reference():
    """Each row's history is the committed output then its path's draft tokens (spec/processing.py)."""
    g = torch.Generator().manual_seed(0)
    tokens, parents = [9, 3, 7, 7, 3, 5], [-1, 0, 1, 0, 3, 2]
    prompt, output = [1, 2, 3], [7, 7, 4]
    for params in PROCESSING.values():
        logits = torch.randn(len(tokens), 48, generator=g) * 3
        processor = PathProcessor(params, prompt, 48)
        processor.commit(output)
        fast = processor.apply(logits, torch.tensor(tokens), torch.tensor(parents))
        slow = processed_reference(logits, params, prompt, output, tokens, parents)
        assert torch.allclose(fast.double(), slow, atol=1e-5), params


def test_the_reference_catches_a_processor_that_ignores_the_path():
    """Negative control: committed history alone (no path) differs from the definition."""
    params = PROCESSING["frequency"]
    tokens, parents = [9, 3, 3], [-1, 0, 1]
    logits = torch.zeros(3, 12)
    slow = processed_reference(logits, params, [], [], tokens, parents)
    assert slow[2, 3] == -2 * 0.9 and slow[1, 3] == -0.9 and slow[0, 3] == 0


def test_min_p_drops_tokens_below_the_floor():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = warp_probs(logits, SamplingParams(temperature=1.0, min_p=0.2))  # floor 0.1
    assert torch.allclose(p, torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95)


@pytest.mark.parametrize("name", list(PROCESSING))
def test_greedy_speculative_equals_plain_with_processing(target, name):
    params = PROCESSING[name]
    requests = [Request(list(p), 24, params) for p in PROMPTS]
    plain = generate_ids(target, requests, set())
    unprocessed = generate_ids(target, [Request(list(p), 24) for p in PROMPTS], set())
    assert [d.token_ids for d in plain] != [d.token_ids for d in unprocessed]  # it changes the output
    rounds = {}
    for label, spec in speculators(target):
        fast = generate_ids(target, requests, set(), speculation=spec)
        assert [d.token_ids for d in fast] == [d.token_ids for d in plain], label
        rounds[label] = sum(d.round_stats.rounds for d in fast)
    # rounds of several tokens really ran (drafts on processed paths were accepted): trees too,
    # where the penalties leave the target's own unprocessed drafts room to be right
    assert min(rounds.values()) < sum(d.round_stats.rounds for d in plain)
    if name != "logit_bias":
        assert rounds["self dynamic:3,6"] < rounds["self chain"] < sum(d.round_stats.rounds for d in plain)


def test_seeded_sampling_with_processing_is_the_plain_sample(target):
    """Drafts verified by the tree walk commit the token plain sampling draws at each position
    (positional randomness): with the processing and min-p on, too."""
    params = SamplingParams(temperature=0.8, min_p=0.05, repetition_penalty=1.4, frequency_penalty=0.3,
                            logit_bias={12: 3.0}, seed=11)
    requests = [Request(list(p), 20, params) for p in PROMPTS]
    plain = generate_ids(target, requests, set())
    spec = Speculator(SpecOptions("ngram", "chain", "fixed:3"), NgramDrafter(), FixedController(3),
                      parse_shape("chain"))
    assert [d.token_ids for d in generate_ids(target, requests, set(), speculation=spec)] == \
        [d.token_ids for d in plain]


def test_stop_token_ids_end_the_output_kept(target):
    ref = generate_ids(target, [Request(PROMPTS[0], 20)], set())[0].token_ids
    stop = next(t for i, t in enumerate(ref) if i >= 3 and t not in ref[:i])
    at = ref.index(stop)
    for spec in (None, dict(speculators(target))["self static:2,2,1"]):
        done = generate_ids(target, [Request(PROMPTS[0], 20, stop_token_ids=(stop,))], set(), speculation=spec)[0]
        assert done.token_ids == ref[: at + 1] and done.finish_reason == "stop"


def test_logprobs_are_the_targets_and_equal_under_speculation(target):
    requests = [Request(list(p), 12, logprobs=3) for p in PROMPTS]
    plain = generate_ids(target, requests, set())
    fast = generate_ids(target, requests, set(), speculation=dict(speculators(target))["self dynamic:3,6"])
    for a, b in zip(plain, fast):
        assert len(a.logprobs) == len(a.token_ids) and [x.token for x in a.logprobs] == a.token_ids
        assert b.token_ids == a.token_ids
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.token == y.token and abs(x.logprob - y.logprob) < 1e-4
            assert [t for t, _ in x.top] == [t for t, _ in y.top] and len(x.top) == 3
            assert x.top[0][1] >= x.top[1][1] >= x.top[2][1] and x.logprob <= x.top[0][1] + 1e-6
            assert x.top[0][0] == x.token  # greedy: the chosen token is the likeliest


def test_logprobs_match_a_plain_forward(target):
    """The committed tokens' logprobs equal log-softmax of the target's logits over prompt + output."""
    from outrider.models.batch import pack

    done = generate_ids(target, [Request(PROMPTS[1], 8, logprobs=0)], set())[0]
    ids = PROMPTS[1] + done.token_ids
    cache = target.new_cache(1, 64)
    out = target.forward(pack([0], [0], [torch.tensor(ids[:-1])], logits="real", scratch_row=cache.scratch_row,
                              device="cpu"), cache)
    ref = torch.log_softmax(out.logits.float(), -1)[len(PROMPTS[1]) - 1:]  # rows predicting the outputs
    for k, x in enumerate(done.logprobs):
        assert abs(x.logprob - float(ref[k, x.token])) < 1e-4 and x.top == ()


def test_prompt_logprobs_and_a_shared_prefill(target):
    """prompt_logprobs: the first prompt token has none, the others their log-probability; a
    request with prefill_from copies the prompt's K/V (no prefill forward of its own) and gives
    the same output as computing it."""
    engine = EngineLoop(target, set(), max_running=3, max_len=64)
    params = SamplingParams(temperature=0.9, seed=3)
    first = engine.add(Request(PROMPTS[2], 10, params, prompt_logprobs=2))
    calls, forward = [], target.forward
    target.forward = lambda *a, **k: calls.append(a[0].tokens.shape) or forward(*a, **k)
    try:
        events = []
        for _ in range(3):
            events += engine.step()
        second = engine.add(Request(PROMPTS[2], 10, params, prefill_from=first))
        before = len(calls)
        while engine.has_work:
            events += engine.step()
    finally:
        del target.forward
    done = {e.request_id: e.completion for e in events if e.completion is not None}
    assert done[first].token_ids == done[second].token_ids  # same prompt, same seed, same text
    assert all(shape[1] == 1 for shape in calls[before:])  # no prefill forward after the copy
    prompt_lp = done[first].prompt_logprobs
    assert prompt_lp[0] is None and [x.token for x in prompt_lp[1:]] == PROMPTS[2][1:]
    assert all(len(x.top) == 2 for x in prompt_lp[1:])
    alone = generate_ids(target, [Request(PROMPTS[2], 10, params)], set())[0]
    assert alone.token_ids == done[second].token_ids


@pytest.mark.parametrize("request_, message", [
    (Request([3, 96, 4], 4), "prompt token id 96 is outside the model's vocabulary of 96"),
    (Request([3, 4], 4, stop_token_ids=(200,)), "stop_token_ids entry 200"),
    (Request([3, 4], 4, SamplingParams(logit_bias={96: 1.0})), "logit_bias token id 96"),
])
def test_token_ids_outside_the_vocabulary_are_refused(target, request_, message):
    engine = EngineLoop(target, set(), max_running=1, max_len=32)
    with pytest.raises(ConfigError, match=message):
        engine.add(request_)
