"""Faults stay with their request (issue 25 item 1): a drafter that raises (proposing, starting,
following), an invalid tree, non-finite logits or a verifier that raises end that request alone
with finish_reason "error"; the others finish with exactly the output they have alone. An
exception in the target's forward is nobody's: it leaves `step()`."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from enumerate_law import one_thread
from tiny import make_tiny

from outrider.control.controllers import FixedController
from outrider.drafters.ngram import NgramDrafter
from outrider.engine import loop as loop_module
from outrider.engine.generate import generate_ids
from outrider.engine.loop import EngineLoop
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.sampling import SamplingParams
from outrider.spec.shapes import parse_shape
from outrider.spec.types import DraftTree
from outrider.weights.loader import load_decoder

PROMPTS = [[3, 4, 5, 3, 4, 5, 3], [10, 11, 12, 10, 11, 12, 10], [20, 21, 20, 21, 20, 21, 20], [6, 7, 6, 7, 6]]
BAD = 1  # the request that meets the fault


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load_decoder(make_tiny("llama", tmp_path_factory.mktemp("faults") / "t", vocab=64, seed=4), "cpu")


class FaultyNgram(NgramDrafter):
    """n-grams, except for the sequence whose prompt starts with `bad`: `where` raises."""

    def __init__(self, bad: int, where: str):
        super().__init__()
        self.bad, self.where, self.prompts = bad, where, {}

    def start(self, seq_id, prompt, params=None):
        self.prompts[seq_id] = prompt[0]
        if self.where == "start" and prompt[0] == self.bad:
            raise RuntimeError("injected fault in start")
        super().start(seq_id, prompt, params)

    def propose(self, seq_id, tokens, budget):
        if self.where == "propose" and self.prompts[seq_id] == self.bad and len(tokens) > 10:
            raise RuntimeError("injected fault in propose")
        if self.where == "tree" and self.prompts[seq_id] == self.bad:
            return DraftTree(torch.tensor([tokens[-1], 5, 6]), torch.tensor([-1, 0, 2]))  # a cycle
        if self.where == "probs" and self.prompts[seq_id] == self.bad:  # a row of q short
            return DraftTree(torch.tensor([tokens[-1], 5]), torch.tensor([-1, 0]), torch.full((1, 64), 1 / 64))
        return super().propose(seq_id, tokens, budget)

    def update(self, seq_id, result, hidden=None):
        if self.where == "update" and self.prompts[seq_id] == self.bad:
            raise RuntimeError("injected fault in update")
        super().update(seq_id, result, hidden)

    def finish(self, seq_id, tokens):
        if self.where == "finish" and self.prompts.get(seq_id) == self.bad:
            raise RuntimeError("injected fault in finish")
        super().finish(seq_id, tokens)


def speculator(drafter) -> Speculator:
    return Speculator(SpecOptions("ngram", "chain", "fixed:3"), drafter, FixedController(3), parse_shape("chain"))


def alone(target, prompt, params=SamplingParams()):
    return generate_ids(target, [Request(list(prompt), 16, params)], set())[0]


@pytest.mark.parametrize("where", ["start", "propose", "tree", "probs", "update"])
def test_a_faulty_drafter_fails_its_request_alone(target, where):
    spec = speculator(FaultyNgram(PROMPTS[BAD][0], where))
    done = generate_ids(target, [Request(list(p), 16) for p in PROMPTS], set(), speculation=spec)
    assert done[BAD].finish_reason == "error"
    invalid = {"tree": "node 2 has parent 2; parents must point to an earlier node (0 <= parent < 2)",
               "probs": "draft_probs (1, 64) must be [n=2, vocab]"}
    if where in invalid:
        assert done[BAD].error == (f"the drafter proposed an invalid draft tree: {invalid[where]} (a bug in the "
                                   "drafter; nothing was committed)")
    else:
        what = {"start": "start", "propose": "propose", "update": "follow the commit"}[where]
        assert done[BAD].error == f"the drafter failed to {what}: RuntimeError: injected fault in {where}"
    for i, (p, d) in enumerate(zip(PROMPTS, done)):
        if i != BAD:
            assert d.finish_reason == "length" and d.token_ids == alone(target, p).token_ids, i


def test_a_drafter_failing_to_finish_keeps_the_output(target):
    """The request ended (length) with its tokens; the drafter's failure to let go is its error."""
    spec = speculator(FaultyNgram(PROMPTS[BAD][0], "finish"))
    done = generate_ids(target, [Request(list(p), 16) for p in PROMPTS], set(), speculation=spec)
    for i, (p, d) in enumerate(zip(PROMPTS, done)):
        assert d.finish_reason == "length" and d.token_ids == alone(target, p).token_ids, i
        assert d.error == ("the drafter failed to finish: RuntimeError: injected fault in finish" if i == BAD
                           else None), i


def test_failures_to_start_are_reported_from_every_prefill_path(target):
    """A drafter that cannot start fails its request wherever the prompt's K/V came from: a
    one-token prompt (nothing to prefill), the plain prefill forward, a copied shared prompt; in
    a step where other requests start through the other paths (prompt logprobs have a forward of
    their own), every request gets its completion, the failed ones with their error event."""
    engine = EngineLoop(target, set(), speculator(FaultyNgram(13, "start")), max_running=8, max_len=64)
    source = engine.add(Request([40, 41, 42, 43], 6))
    engine.step()  # the source decodes from now on
    ids = {"one-token": engine.add(Request([13], 6)), "one-token ok": engine.add(Request([20], 6)),
           "plain": engine.add(Request([13, 7, 8], 6)), "logged": engine.add(Request([21, 7, 8], 6, prompt_logprobs=1)),
           "copied": engine.add(Request([40, 41, 42, 43], 6, prefill_from=source))}
    first = engine.step()
    done = {e.request_id: e for e in first if e.completion is not None}
    for name in ("one-token", "plain"):
        event = done.pop(ids[name])
        assert event.new_tokens == [] and event.completion.finish_reason == "error"
        assert event.completion.error == "the drafter failed to start: RuntimeError: injected fault in start"
    assert done == {}
    while engine.has_work:
        done.update({e.request_id: e for e in engine.step() if e.completion is not None})
    assert sorted(done) == sorted([source, ids["one-token ok"], ids["logged"], ids["copied"]])
    assert all(e.completion.finish_reason == "length" for e in done.values())
    assert done[ids["copied"]].completion.token_ids == done[source].completion.token_ids


def test_a_cancelled_request_that_never_started_is_not_finished_by_the_drafter(target):
    class Strict(NgramDrafter):  # finishing a sequence it never started is the engine's bug
        def finish(self, seq_id, tokens):
            if seq_id not in self._states:
                raise KeyError(f"sequence {seq_id} never started")
            super().finish(seq_id, tokens)

    engine = EngineLoop(target, set(), speculator(Strict()), max_running=1, max_len=64)
    first = engine.add(Request(list(PROMPTS[0]), 4))
    waiting = engine.add(Request(list(PROMPTS[BAD]), 4))
    engine.step()
    engine.cancel(waiting)
    done = {}
    while engine.has_work:
        done.update({e.request_id: e.completion for e in engine.step() if e.completion is not None})
    assert (done[waiting].finish_reason, done[waiting].error, done[waiting].token_ids) == ("cancelled", None, [])
    assert (done[first].finish_reason, done[first].error) == ("length", None)


def test_a_faulty_request_alone_in_its_round(target):
    """Every sequence of the round fails to propose: the round verifies none and the engine goes on."""
    spec = speculator(FaultyNgram(PROMPTS[BAD][0], "propose"))
    done = generate_ids(target, [Request(list(PROMPTS[BAD]), 16)], set(), speculation=spec)[0]
    assert done.finish_reason == "error" and "injected fault in propose" in done.error
    again = generate_ids(target, [Request(list(PROMPTS[0]), 16)], set(), speculation=spec)[0]
    assert again.token_ids == alone(target, PROMPTS[0]).token_ids


def test_non_finite_logits_fail_their_request_alone(target, monkeypatch):
    """NaN in the logits of one slot's rows: that request fails, the others' outputs are unchanged."""
    forward, calls = target.forward, [0]

    def poisoned(batch, cache):
        calls[0] += 1
        out = forward(batch, cache)
        if out.logits.shape == (len(batch.slot_ids), 64):  # one row a slot: a decode round (not the prefill)
            for row, slot in enumerate(batch.slot_ids):
                if slot == BAD:
                    with torch.inference_mode():  # the forward's own tensors
                        out.logits[row, 7] = float("nan")
        return out

    monkeypatch.setattr(target, "forward", poisoned)
    done = generate_ids(target, [Request(list(p), 16) for p in PROMPTS], set())
    monkeypatch.undo()
    assert done[BAD].finish_reason == "error"
    assert done[BAD].error == "the target's logits are not finite (NaN or inf) for this request"
    for i, (p, d) in enumerate(zip(PROMPTS, done)):
        if i != BAD:
            assert d.token_ids == alone(target, p).token_ids, i
    assert calls[0] == 1 + 16  # one prefill, one round a token: the requests after BAD lost no round


def test_a_verifier_that_raises_fails_its_request_alone(target, monkeypatch):
    choose = loop_module.choose_verifier

    def faulty(kind, gives_probs, params, **kw):
        choice = choose(kind, gives_probs, params, **kw)
        if params.seed == 13:
            def broken(*args, **kwargs):
                raise ValueError("injected fault in the verifier")
            return dataclasses.replace(choice, verifier=broken)
        return choice

    monkeypatch.setattr(loop_module, "choose_verifier", faulty)
    forward, calls = target.forward, []
    monkeypatch.setattr(target, "forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    params = [SamplingParams(temperature=0.8, seed=13 if i == BAD else 5) for i in range(len(PROMPTS))]
    done = generate_ids(target, [Request(list(p), 16, sp) for p, sp in zip(PROMPTS, params)], set())
    monkeypatch.undo()
    assert done[BAD].finish_reason == "error"
    assert done[BAD].error == "verification failed: ValueError: injected fault in the verifier"
    for i, (p, d) in enumerate(zip(PROMPTS, done)):
        if i != BAD:
            assert d.token_ids == alone(target, p, params[i]).token_ids, i
    assert len(calls) == 1 + 16  # one prefill, one round a token: the requests after BAD lost no round


def test_an_error_in_the_forward_leaves_step(target, monkeypatch):
    engine = EngineLoop(target, set(), max_running=2, max_len=64)
    engine.add(Request(PROMPTS[0], 8))
    engine.step()

    def broken(batch, cache):
        raise RuntimeError("the device is gone")

    monkeypatch.setattr(target, "forward", broken)
    with pytest.raises(RuntimeError, match="the device is gone"):
        engine.step()
