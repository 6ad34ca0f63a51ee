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
        return super().propose(seq_id, tokens, budget)

    def update(self, seq_id, result, hidden=None):
        if self.where == "update" and self.prompts[seq_id] == self.bad:
            raise RuntimeError("injected fault in update")
        super().update(seq_id, result, hidden)


def speculator(drafter) -> Speculator:
    return Speculator(SpecOptions("ngram", "chain", "fixed:3"), drafter, FixedController(3), parse_shape("chain"))


def alone(target, prompt, params=SamplingParams()):
    return generate_ids(target, [Request(list(prompt), 16, params)], set())[0]


@pytest.mark.parametrize("where", ["start", "propose", "tree", "update"])
def test_a_faulty_drafter_fails_its_request_alone(target, where):
    spec = speculator(FaultyNgram(PROMPTS[BAD][0], where))
    done = generate_ids(target, [Request(list(p), 16) for p in PROMPTS], set(), speculation=spec)
    assert done[BAD].finish_reason == "error"
    assert ("invalid draft tree" if where == "tree" else f"injected fault in {where}") in done[BAD].error
    for i, (p, d) in enumerate(zip(PROMPTS, done)):
        if i != BAD:
            assert d.finish_reason == "length" and d.token_ids == alone(target, p).token_ids, i


def test_a_faulty_request_alone_in_its_round(target):
    """Every sequence of the round fails to propose: the round verifies none and the engine goes on."""
    spec = speculator(FaultyNgram(PROMPTS[BAD][0], "propose"))
    done = generate_ids(target, [Request(list(PROMPTS[BAD]), 16)], set(), speculation=spec)[0]
    assert done.finish_reason == "error" and "injected fault in propose" in done.error
    again = generate_ids(target, [Request(list(PROMPTS[0]), 16)], set(), speculation=spec)[0]
    assert again.token_ids == alone(target, PROMPTS[0]).token_ids


def test_non_finite_logits_fail_their_request_alone(target, monkeypatch):
    """NaN in the logits of one slot's rows: that request fails, the others' outputs are unchanged."""
    forward = target.forward

    def poisoned(batch, cache):
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
    assert done[BAD].finish_reason == "error" and "not finite" in done[BAD].error
    for i, (p, d) in enumerate(zip(PROMPTS, done)):
        if i != BAD:
            assert d.token_ids == alone(target, p).token_ids, i


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
    params = [SamplingParams(temperature=0.8, seed=13 if i == BAD else 5) for i in range(len(PROMPTS))]
    done = generate_ids(target, [Request(list(p), 16, sp) for p, sp in zip(PROMPTS, params)], set())
    monkeypatch.undo()
    assert done[BAD].finish_reason == "error" and "injected fault in the verifier" in done[BAD].error
    for i, (p, d) in enumerate(zip(PROMPTS, done)):
        if i != BAD:
            assert d.token_ids == alone(target, p, params[i]).token_ids, i


def test_an_error_in_the_forward_leaves_step(target, monkeypatch):
    engine = EngineLoop(target, set(), max_running=2, max_len=64)
    engine.add(Request(PROMPTS[0], 8))
    engine.step()

    def broken(batch, cache):
        raise RuntimeError("the device is gone")

    monkeypatch.setattr(target, "forward", broken)
    with pytest.raises(RuntimeError, match="the device is gone"):
        engine.step()
