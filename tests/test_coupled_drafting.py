"""Coupled drafting wired through the engine, for every drafter that declares `couples` (issue 38).

A seeded request is verified by the walk, and a drafter that samples its chain then draws its
draft at absolute position t as `categorical(q_t, u_t)`, u_t the uniform of (seed, t, TOKEN),
the very uniform the walk commits `categorical(p_t, u_t)` with (drafters/capabilities.py). An
unseeded request is verified by rejection sampling, which needs drafts apart from its own
draws: there the chain is drawn on the drafter's own streams. Each proposal is recorded on its
way to the verifier and every draft checked against the draw it must be, from the q the tree
carries; the text of a seeded run is plain sampling's (tests/test_seed_reproducible.py proves it
for every controller; tests/test_verify_coupled.py enumerates the law).
"""

import pytest
from enumerate_law import one_thread
from test_dflash_spec import head_for
from test_spec_sampling_exact import eagle3_speculator
from tiny import make_tiny

from outrider.control.controllers import FixedController
from outrider.drafters.dflash import DFlashDrafter
from outrider.drafters.model import ModelDrafter
from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.sampling import SamplingParams
from outrider.spec.random import PositionalRandom
from outrider.spec.shapes import parse_shape
from outrider.weights.loader import load_decoder

PROMPTS = [[3, 4, 5, 3, 4, 5, 3], [6, 7, 3, 6, 7, 3, 6]]
PARAMS = SamplingParams(temperature=0.9, top_k=6)
DEPTH = 3


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("coupled8")
    target = load_decoder(make_tiny("llama", root / "t", vocab=8, layers=4), "cpu")
    draft = load_decoder(make_tiny("llama", root / "d", vocab=8, seed=3, layers=1), "cpu")
    return target, draft


def chain(drafter) -> Speculator:
    return Speculator(SpecOptions(drafter.name, "chain", f"fixed:{DEPTH}"), drafter, FixedController(DEPTH),
                      parse_shape("chain"))


DRAFTERS = {
    "draft-model": lambda t, d: chain(ModelDrafter(d, parse_shape("chain"), name="draft-model:tiny")),
    "early-exit": lambda t, d: chain(ModelDrafter(t, parse_shape("chain"), num_layers=1, name="early-exit:1")),
    "eagle3": lambda t, d: eagle3_speculator(t, "chain", DEPTH),
    "dflash": lambda t, d: chain(DFlashDrafter(head_for(t), parse_shape("chain"), head_for(t).config.taps(4))),
}


def recorded_run(target, spec: Speculator, seed: int) -> tuple[list, list]:
    """Completions of PROMPTS with this seed, and every proposal as (first position it drafts, its tree)."""
    proposals = []
    propose = spec.drafter.propose_batch

    def recording(seq_ids, tokens, budgets):
        trees = propose(seq_ids, tokens, budgets)
        proposals.extend((len(t), tree) for t, tree in zip(tokens, trees))
        return trees

    spec.drafter.propose_batch = recording
    params = SamplingParams(PARAMS.temperature, PARAMS.top_k, seed=seed)
    done = generate_ids(target, [Request(list(p), 12, params) for p in PROMPTS], set(), speculation=spec)
    return done, proposals


def drawn_as(proposals, rng) -> bool:
    """Whether every draft is rng's categorical draw from its q at its position."""
    checked = 0
    for first, tree in proposals:
        for d in range(1, tree.size):
            if int(tree.tokens[d]) != rng.at(first).categorical(tree.draft_probs[d - 1], offset=d - 1):
                return False
            checked += 1
    assert checked > 10, "too few drafts to check"
    return True


@pytest.mark.parametrize("name", DRAFTERS)
def test_a_seeded_chain_is_drawn_with_the_walks_uniforms(models, name):
    target, draft = models
    assert DRAFTERS[name](target, draft).couples
    done, proposals = recorded_run(target, DRAFTERS[name](target, draft), seed=9)
    assert drawn_as(proposals, PositionalRandom(9))  # the verifier's own TOKEN uniforms
    assert not drawn_as(proposals, PositionalRandom(9).drafting())
    plain = generate_ids(target, [Request(list(p), 12, SamplingParams(PARAMS.temperature, PARAMS.top_k, seed=9))
                                  for p in PROMPTS], set())
    assert [f.token_ids for f in done] == [f.token_ids for f in plain]


@pytest.mark.parametrize("name", DRAFTERS)
def test_a_chain_verified_by_rejection_sampling_is_drawn_apart(models, name):
    """Rejection sampling (named here; an unseeded request's default) needs drafts independent
    of its own draws: the chain comes from the drafter's own streams, seed or not."""
    target, draft = models
    made = DRAFTERS[name](target, draft)
    spec = Speculator(SpecOptions(made.options.drafter, "chain", f"fixed:{DEPTH}", verifier="rejection_chain"),
                      made.drafter, made.controller, made.shape)
    _, proposals = recorded_run(target, spec, seed=9)
    assert drawn_as(proposals, PositionalRandom(9).drafting())
    assert not drawn_as(proposals, PositionalRandom(9))
