"""`--drafter hybrid:[K,]DRAFTER`: suffix trees where they are confident, DRAFTER elsewhere.

Greedy output equals autoregressive output with an EAGLE-3 head (hidden states handed through)
and a draft model, chains and trees, with both sources proposing in the same run and sequences
joining while others decode; sampled output equals plain sampling with the same seed (its trees
carry no probabilities: the tree walk); bad arguments get one-line errors.
"""

import re

import pytest
from eagle3_tiny import target_with_head
from enumerate_law import one_thread
from tiny import add_tokenizer, make_tiny

from outrider.drafters.hybrid import HybridDrafter
from outrider.errors import ConfigError
from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.weights.loader import load_decoder
from outrider.sampling import SamplingParams
from outrider.engine.loop import EngineLoop
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.spec.verifiers import VERIFIERS

# repeats (the suffix trees' part) and a prompt that does not repeat (the other drafter's)
PROMPTS = [[3, 4, 5, 6, 3, 4, 5, 6, 3, 4, 5], [6, 7, 3, 6, 7, 3, 6, 7], [5], [1, 2, 7, 4, 6, 3]]


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A vocab-8 target, a head with 6 draft tokens over three of its layers, a draft model."""
    root = tmp_path_factory.mktemp("hybrid")
    folder, head = target_with_head(root)
    draft = make_tiny("llama", root / "d", vocab=8, layers=2, seed=5)
    for model in (folder, draft):  # the same tokenizer: a draft model must share the target's
        add_tokenizer(model, vocab=8)
    return folder, load_decoder(folder, "cpu"), {"eagle3": f"eagle3:{head}", "draft-model": f"draft-model:{draft}"}


def run(target, spec, params=SamplingParams(), n=24, **engine):
    requests = [Request(list(p), n, params) for p in PROMPTS]
    if not engine:
        return [f.token_ids for f in generate_ids(target, requests, set(), speculation=spec)]
    return [f.token_ids for f in EngineLoop(target, set(), spec, **engine).run_all(requests)]


@pytest.mark.parametrize("other, tree", [("eagle3", "chain"), ("eagle3", "dynamic:2,5"),
                                         ("draft-model", "chain"), ("draft-model", "static:2,1")])
def test_greedy_equals_autoregressive_with_both_sources(setup, other, tree):
    folder, target, drafters = setup
    spec = Speculator.build(SpecOptions(f"hybrid:2,{drafters[other]}", tree, "fixed:5"), target, folder)
    hybrid = spec.drafter
    assert isinstance(hybrid, HybridDrafter) and hybrid.depth == 2
    assert spec.verifier_for(SamplingParams()) is VERIFIERS["greedy_tree"].verify
    if other == "eagle3":
        assert spec.hidden_layers == (1, 2, 3)  # the head's layers, declared through the hybrid
    hybrid.min_score = 1.0  # the tiny model's repeats are short: let the suffix trees in
    plain = run(target, None)
    assert run(target, spec) == plain
    assert hybrid.suffix_rounds > 0 and hybrid.other_rounds > 0  # both proposed
    assert run(target, spec, max_running=2, chunk_size=3) == plain  # sequences join mid-run


def test_sampled_output_equals_plain_sampling(setup):
    folder, target, drafters = setup
    spec = Speculator.build(SpecOptions(f"hybrid:{drafters['eagle3']}", "chain", "fixed:3"), target, folder)
    spec.drafter.min_score = 1.0
    params = SamplingParams(temperature=1.0, seed=3)
    assert spec.verifier_for(params) is VERIFIERS["tree_walk"].verify
    assert run(target, spec, params) == run(target, None, params)


@pytest.mark.parametrize("text, message", [
    ("hybrid", "name the drafter to use where suffix decoding is not confident"),
    ("hybrid:0,ngram", "K (the other drafter's depth) must be >= 1"),
    ("hybrid:suffix", "cannot be suffix"),
    ("hybrid:hybrid:ngram", "cannot be hybrid"),
    ("hybrid:warp", "unknown drafter"),
])
def test_bad_arguments_say_what_to_pass(text, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as err:
        SpecOptions(text).check()
    assert "\n" not in str(err.value)


def test_a_tree_the_other_drafter_cannot_build_is_refused(setup):
    folder, target, _ = setup
    with pytest.raises(ConfigError, match="--tree dynamic does not fit --drafter hybrid:ngram: ngram builds only --tree chain"):
        Speculator.build(SpecOptions("hybrid:ngram", "dynamic:2,4", "fixed:3"), target, folder)


def test_the_threshold_rises_to_what_the_other_drafter_gets_accepted(setup):
    """Beside a drafter whose proposals are all accepted (the target drafting for itself, 3 deep),
    the suffix trees must expect more than that to propose: the threshold follows the running mean
    of the other drafter's accepted tokens, never below MIN_SCORE."""
    from outrider.drafters.hybrid import MIN_SCORE

    folder, target, _ = setup
    spec = Speculator.build(SpecOptions(f"hybrid:3,draft-model:{folder}", "chain", "fixed:5"), target, folder)
    hybrid = spec.drafter
    assert hybrid.threshold == MIN_SCORE
    assert run(target, spec) == run(target, None)
    assert hybrid.other_rounds > 0 and 2.5 < hybrid.other_accepted <= 3.0
    assert hybrid.threshold == hybrid.other_accepted


def test_a_drafter_over_the_targets_cache_is_refused(setup):
    folder, target, _ = setup
    with pytest.raises(ConfigError, match="over the target's own cache cannot skip rounds"):
        Speculator.build(SpecOptions("hybrid:early-exit:1", "chain", "fixed:3"), target, folder)
