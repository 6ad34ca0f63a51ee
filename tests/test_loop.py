"""engine/loop.py's scheduling inside a step: the prefill budget spent in order, a shared prompt's
K/V copied only when it is there, cancellation, events and time figures (mutation testing,
issue 29: each of these changed no output token in the other tests when mutated)."""

from __future__ import annotations

import pytest
import torch

from enumerate_law import one_thread

from outrider.control.controllers import FixedController
from outrider.drafters.ngram import NgramDrafter
from outrider.engine.generate import generate_ids
from outrider.engine.loop import EngineLoop
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.spec.shapes import parse_shape
from outrider.weights.loader import load_decoder


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def target(tiny_folders):
    return load_decoder(tiny_folders["llama"], "cpu")


def ngram() -> Speculator:
    return Speculator(SpecOptions("ngram", "chain", "fixed:3"), NgramDrafter(), FixedController(3), parse_shape("chain"))


def alone(target, prompt, n=6):
    return generate_ids(target, [Request(list(prompt), n)], set())[0].token_ids


class Fills:
    """Records the prefill forwards (those that only write the cache): (slots, first cache row, tokens) each."""

    def __init__(self, target, monkeypatch):
        self.seen, forward = [], target.forward

        def recording(batch, cache):
            if batch.fills_only:
                real = (batch.rows != cache.scratch_row).sum(-1).tolist()
                self.seen.append((batch.slot_ids, batch.positions[:, 0].tolist(), real))
            return forward(batch, cache)

        monkeypatch.setattr(target, "forward", recording)


def drain(engine, steps=40):
    """Step until nothing is left (at most `steps`): the completions by request id, and the events."""
    done, events = {}, []
    for _ in range(steps):
        if not engine.has_work:
            break
        for event in engine.step():
            events.append(event)
            if event.completion is not None:
                done[event.request_id] = event.completion
    assert not engine.has_work, "the engine did not finish"
    return done, events


def test_chunked_prefill_spends_the_budget_in_order(target, monkeypatch):
    """chunk_size 3: each step's prefill takes up to 3 prompt tokens, oldest request first, a
    request's whole remainder when it fits, the rest of the budget for the next; a one-token
    prompt has nothing to prefill and decodes at once."""
    prompts = [[7], [8, 9, 10], list(range(11, 20)), [30, 31, 32, 33, 34]]  # 0, 2, 8, 4 tokens to prefill
    fills = Fills(target, monkeypatch)
    engine = EngineLoop(target, set(), max_running=4, max_len=64, chunk_size=3)
    ids = [engine.add(Request(p, 6)) for p in prompts]
    done, _ = drain(engine)
    assert fills.seen == [([1, 2], [0, 0], [2, 1]), ([2], [1], [3]), ([2], [4], [3]), ([2, 3], [7, 0], [1, 2]),
                          ([3], [2], [2])]
    monkeypatch.undo()
    for i, p in zip(ids, prompts):
        assert done[i].token_ids == alone(target, p) and done[i].finish_reason == "length"


def test_prompt_logprobs_over_chunks_equal_the_whole_prompts(target):
    prompt = list(range(40, 50))
    whole = generate_ids(target, [Request(prompt, 3, prompt_logprobs=2)], set())[0]
    engine = EngineLoop(target, set(), max_running=1, max_len=64, chunk_size=4)
    rid = engine.add(Request(prompt, 3, prompt_logprobs=2))
    chunked = drain(engine)[0][rid]
    assert chunked.token_ids == whole.token_ids and chunked.prompt_logprobs[0] is None
    assert [x.token for x in chunked.prompt_logprobs[1:]] == prompt[1:]
    for x, y in zip(chunked.prompt_logprobs[1:], whole.prompt_logprobs[1:]):
        assert abs(x.logprob - y.logprob) < 1e-4 and [t for t, _ in x.top] == [t for t, _ in y.top]


@pytest.mark.parametrize("speculation", [False, True])
def test_a_shared_prompt_is_copied_only_once_it_is_in_the_cache(target, monkeypatch, speculation):
    """prefill_from copies the source's prompt K/V when the source decodes with the same prompt
    (also with an n-gram drafter, which reads no hidden states); not from a source whose prompt
    is still being prefilled in this very step, nor from one with another prompt."""
    prompt, other = [50, 51, 52, 53, 54, 55], [60, 61, 62, 63, 64, 65]
    fills = Fills(target, monkeypatch)
    engine = EngineLoop(target, set(), ngram() if speculation else None, max_running=4, max_len=64)
    src = engine.add(Request(prompt, 6))
    early = engine.add(Request(prompt, 6, prefill_from=src))  # same step: src is not in the cache yet
    events = engine.step()
    assert fills.seen == [([0, 1], [0, 0], [5, 5])] and not any(e.completion for e in events)
    late = engine.add(Request(prompt, 6, prefill_from=src))  # src decodes now: copied, no forward
    stranger = engine.add(Request(other, 6, prefill_from=src))  # another prompt: its own prefill
    done, _ = drain(engine)
    assert fills.seen[1:] == [([3], [0], [5])]
    monkeypatch.undo()
    for rid, p in ((src, prompt), (early, prompt), (late, prompt), (stranger, other)):
        assert done[rid].token_ids == alone(target, p), rid


def test_cancelled_requests_end_with_no_new_tokens_and_no_error(target):
    engine = EngineLoop(target, set(), ngram(), max_running=1, max_len=64)
    running = engine.add(Request([5, 6, 7, 5, 6], 8))
    waiting = engine.add(Request([9, 10, 11], 8))
    engine.step()
    assert (engine.num_running, engine.num_waiting) == (1, 1)
    engine.cancel(waiting)  # never got a slot
    engine.cancel(running)
    events = engine.step()
    assert sorted(e.request_id for e in events) == [running, waiting] and not engine.has_work
    for e in events:
        assert e.new_tokens == [] and e.completion.finish_reason == "cancelled" and e.completion.error is None
    assert len(events[[e.request_id for e in events].index(running)].completion.token_ids) >= 1
    assert events[[e.request_id for e in events].index(waiting)].completion.token_ids == []


def test_time_figures_add_up_within_the_total(target):
    done = generate_ids(target, [Request([5, 6, 7, 5, 6, 7, 5], 12)], set(), speculation=ngram())[0]
    s = done.stats
    assert s["rounds"] < 12  # the n-gram drafts were accepted sometimes: rounds drafted
    for key in ("prefill_s", "draft_s", "verify_s"):
        assert 0.0 < s[key] <= s["total_s"], key
    assert s["prefill_s"] + s["draft_s"] + s["verify_s"] <= s["total_s"] + 1e-9
