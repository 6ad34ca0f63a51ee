"""Grammar-constrained decoding through the engine on a tiny model, with a Python matcher in
llguidance's place (spec/grammar.py's GrammarState is the real one): the masks, forced chains,
pruning and the end of the grammar as engine/loop.py and engine/round.py apply them. Fast enough
for the mutation groups, where tests/test_grammar.py needs SmolLM2 (mutation testing, issue 29).

The language: FREE_PAIRS times a free token (one of FREE) followed by the two forced tokens SEP,
SEP2; then only EOS."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from enumerate_law import one_thread

from outrider.control.controllers import FixedController
from outrider.drafters.model import ModelDrafter
from outrider.drafters.ngram import NgramDrafter
from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.models.batch import pack
from outrider.sampling import SamplingParams
from outrider.spec.grammar import GrammarState
from outrider.spec.shapes import parse_shape
from outrider.weights.loader import load_decoder

VOCAB, EOS, SEP, SEP2, FREE, FREE_PAIRS = 96, 2, 7, 8, range(10, 30), 4
PROMPT = [10, SEP, SEP2, 11, SEP, SEP2, 10, SEP, SEP2, 11]  # n-grams find SEP SEP2 after a free token


class TriplesMatcher:
    """The subset of llguidance's LLMatcher that GrammarState uses."""

    def __init__(self):
        self.history: list[int] = []

    def allowed(self) -> set[int]:
        n = len(self.history)
        if n >= 3 * FREE_PAIRS:
            return {EOS}
        return set(FREE) if n % 3 == 0 else ({SEP} if n % 3 == 1 else {SEP2})

    def compute_bitmask(self) -> bytes:
        mask = np.zeros(128, dtype=bool)
        mask[sorted(self.allowed())] = True
        return np.packbits(mask, bitorder="little").tobytes()

    def compute_ff_tokens(self) -> list[int]:
        n = len(self.history)
        return [[], [SEP, SEP2], [SEP2]][n % 3] if n < 3 * FREE_PAIRS else []

    def consume_token(self, token: int) -> bool:
        if token == EOS or token not in self.allowed():
            return False
        self.history.append(token)
        return True

    def rollback(self, n: int) -> None:
        del self.history[len(self.history) - n:]

    def is_accepting(self) -> bool:
        return len(self.history) == 3 * FREE_PAIRS

    def get_error(self) -> str:
        return ""


class Triples:
    def state(self) -> GrammarState:
        return GrammarState(TriplesMatcher(), VOCAB, frozenset({EOS}))


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def target(tiny_folders):
    return load_decoder(tiny_folders["llama"], "cpu")


def masked_greedy(target) -> list[int]:
    """The definition, one full forward a token: the argmax over the tokens the grammar allows."""
    out, matcher = [], TriplesMatcher()
    while True:
        cache = target.new_cache(1, 64)
        logits = target.forward(pack([0], [0], [torch.tensor(PROMPT + out)], scratch_row=cache.scratch_row),
                                cache).logits[0, -1]
        allowed = sorted(matcher.allowed())
        out.append(allowed[int(logits[allowed].argmax())])
        if out[-1] == EOS:
            return out
        matcher.consume_token(out[-1])


def speculators(target):
    yield "ngram", Speculator(SpecOptions("ngram", "chain", "fixed:3"), NgramDrafter(), FixedController(3),
                              parse_shape("chain"))
    for shape in ("static:2,2,1", "dynamic:3,6"):  # the target drafting for itself, unconstrained: trees to prune
        yield shape, Speculator(SpecOptions("draft-model:self", shape, "fixed:3"),
                                ModelDrafter(target, parse_shape(shape), name="draft-model:self"),
                                FixedController(3), parse_shape(shape))


def test_greedy_under_the_grammar_is_the_masked_argmax_plain_and_speculative(target):
    want = masked_greedy(target)
    assert len(want) == 3 * FREE_PAIRS + 1 and all(want[i] in FREE for i in range(0, 12, 3))
    plain = generate_ids(target, [Request(PROMPT, 30, grammar=Triples())], {EOS})[0]
    assert (plain.token_ids, plain.finish_reason) == (want, "eos")
    for name, spec in speculators(target):
        rounds = {}
        for drafting in (True, False):
            done = generate_ids(target, [Request(PROMPT, 30, grammar=Triples(), grammar_drafting=drafting)], {EOS},
                                speculation=spec)[0]
            assert (done.token_ids, done.finish_reason, done.error) == (want, "eos", None), (name, drafting)
            rounds[drafting] = done.round_stats.rounds
        assert rounds[True] < plain.round_stats.rounds, name
        if name == "ngram":  # forced SEP SEP2 drafted for free: a round a triple, and the end
            assert rounds[True] <= FREE_PAIRS + 1 < rounds[False]


def test_seeded_sampling_under_the_grammar(target):
    """The tree walk (n-grams) commits the plain sample; a draft model's sampled chain (rejection
    sampling, its forbidden drafts rejected rather than pruned) keeps to the grammar too."""
    params = SamplingParams(temperature=1.0, seed=3)
    plain = generate_ids(target, [Request(PROMPT, 30, params, grammar=Triples())], {EOS})[0]
    out = plain.token_ids
    assert plain.finish_reason == "eos" and len(out) == 13 and [out[i] for i in (1, 2, 4, 5)] == [SEP, SEP2] * 2
    spec = dict(speculators(target))["ngram"]
    assert generate_ids(target, [Request(PROMPT, 30, params, grammar=Triples())], {EOS},
                        speculation=spec)[0].token_ids == out
    sampled = Speculator(SpecOptions("draft-model:self", "chain", "fixed:3"),
                         ModelDrafter(target, parse_shape("chain"), name="draft-model:self"),
                         FixedController(3), parse_shape("chain"))
    for drafting in (True, False):
        done = generate_ids(target, [Request(PROMPT, 30, params, grammar=Triples(), grammar_drafting=drafting)],
                            {EOS}, speculation=sampled)[0]
        ids = done.token_ids
        assert done.finish_reason == "eos" and len(ids) == 13 and all(ids[i] in FREE for i in range(0, 12, 3))
        assert all(ids[i] == SEP and ids[i + 1] == SEP2 for i in range(1, 12, 3)), drafting
