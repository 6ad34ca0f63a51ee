"""Same seed, same text: whatever the drafter, its state, the controller or the batch (issues 7 and 38).

Randomness is drawn by output position (spec/random.py), and a request with a seed is verified
by the walk (spec/verifiers.py), which commits at each position the token plain sampling draws
there: with the same seed the speculative text *is* the autoregressive text, whatever the
drafter proposes and however deep the controller drafts each round (`cost` decides from measured
times, so its depths differ from run to run). A drafter that samples its chain draws it with the
walk's own uniforms (coupled drafting), so its drafts are still accepted often. A verifier named
by the user (here rejection sampling) keeps its own law: reproducible per seed with a fixed
controller, but its text depends on the drafts; the mutant check below shows the first test
would catch a seeded path that used it.
"""

import dataclasses
import random

import pytest
import torch

from enumerate_law import one_thread
from tiny import make_tiny

from outrider import LLM
from outrider.control.controllers import FixedController, PerSequence
from outrider.drafters.base import Budget
from outrider.drafters.model import ModelDrafter
from outrider.drafters.ngram import NgramDrafter
from outrider.drafters.suffix import SuffixDrafter
from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.weights.loader import load_decoder
from outrider.sampling import SamplingParams
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.spec.shapes import parse_shape

PROMPTS = [[3, 4, 5, 3, 4, 5, 3], [6, 7, 3, 6, 7, 3, 6], [5, 5, 4, 5, 5, 4, 5]]
SAMPLING = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=5, top_p=0.9)]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A vocabulary of 8 tokens, so drafts are often right and the speculative paths run."""
    return load_decoder(make_tiny("llama", tmp_path_factory.mktemp("vocab8") / "t", vocab=8, seed=0), "cpu")


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """Many forwards on tiny tensors: intra-op threads only cost time here."""
    with one_thread():
        yield


def speculator(drafter, shape: str, depth: int, controller=None, verifier: str | None = None) -> Speculator:
    return Speculator(SpecOptions(drafter.name, shape, f"fixed:{depth}", verifier=verifier), drafter,
                      controller or FixedController(depth), parse_shape(shape))


def finished(target, spec, params: SamplingParams, seed: int, prompts=PROMPTS, n: int = 16):
    p = SamplingParams(params.temperature, params.top_k, params.top_p, seed)
    return generate_ids(target, [Request(list(x), n, p) for x in prompts], set(), speculation=spec)


def run(target, spec, params: SamplingParams, seed: int, prompts=PROMPTS, n: int = 16) -> list[list[int]]:
    return [f.token_ids for f in finished(target, spec, params, seed, prompts, n)]


@pytest.fixture(scope="module")
def plain(target) -> dict[tuple[int, int], list[list[int]]]:
    """(index in SAMPLING, seed) -> plain seeded sampling's tokens of PROMPTS: the reference the
    speculative runs are compared with, for the seeds they use. Computed once, before any test
    patches the engine (it is a function of the seed; the tests used to recompute it per run)."""
    return {(i, seed): run(target, None, params, seed) for i, params in enumerate(SAMPLING) for seed in (1, 2, 40, 41)}


WALKED = {  # drafters whose drafts are verified by the tree walk: equal to plain sampling
    "ngram": lambda t: speculator(NgramDrafter(), "chain", 4),
    "suffix": lambda t: speculator(SuffixDrafter(), "chain", 6),
    "early_exit_static": lambda t: speculator(ModelDrafter(t, parse_shape("static:2,2,1"), num_layers=1,
                                                           name="early-exit:1"), "static:2,2,1", 3),
    "early_exit_dynamic": lambda t: speculator(ModelDrafter(t, parse_shape("dynamic:3,6"), num_layers=2,
                                                            name="early-exit:2"), "dynamic:3,6", 3),
}


@pytest.mark.parametrize("name", WALKED)
def test_walked_drafts_give_the_autoregressive_sample(target, plain, name):
    spec = WALKED[name](target)
    accepted = 0
    for i, params in enumerate(SAMPLING):
        for seed in (1, 2):  # the speculator's state carries over from call to call
            fast = finished(target, spec, params, seed)
            assert [f.token_ids for f in fast] == plain[i, seed]
            accepted += sum(sum(f.round_stats.accepted_by_position) for f in fast)
    assert accepted > 10, "too few drafts accepted: the speculative path is not exercised"


def test_a_named_verifier_repeats_itself_whatever_the_batch(target):
    """Rejection sampling named with an early-exit chain and a fixed depth: deterministic per seed,
    alone or in any batch."""
    spec = speculator(ModelDrafter(target, parse_shape("chain"), num_layers=1, name="early-exit:1"), "chain", 3,
                      verifier="rejection_chain")
    params = SAMPLING[0]
    together = run(target, spec, params, 5)
    assert run(target, spec, params, 5) == together
    assert [run(target, spec, params, 5, [p])[0] for p in PROMPTS] == together
    assert run(target, spec, params, 5, PROMPTS[::-1]) == together[::-1]
    assert run(target, spec, params, 6) != together


def test_llm_same_seed_same_text_with_a_stateful_drafter(tiny_folders):
    """The issue's case: a suffix drafter whose index carries over, four calls, one seed."""
    folder = str(tiny_folders["llama"])
    prompt = "w5 w6 w7 w5 w6 w7 w5 w6"
    llm = LLM(folder, drafter="suffix", controller="fixed:6")
    texts = [llm.generate(prompt, max_new_tokens=20, temperature=0.7, seed=1).text for _ in range(4)]
    assert len(set(texts)) == 1
    plain = LLM(folder).generate(prompt, max_new_tokens=20, temperature=0.7, seed=1).text
    assert texts[0] == plain
    batch = llm.generate(["w9 w10", prompt, prompt], max_new_tokens=20, temperature=0.7, seed=1)
    assert batch[1].text == batch[2].text == plain  # a prompt's text does not depend on its place


def test_unseeded_runs_follow_torch_manual_seed(target):
    params = SAMPLING[0]
    torch.manual_seed(0)
    a = run(target, None, params, None)
    torch.manual_seed(0)
    assert run(target, None, params, None) == a


# -- the seeded walk: speculative text == autoregressive text, whatever the depths (issue 38) ----
class RandomDepths(PerSequence):
    """Each round's depth drawn at random in 0..max_depth (0: the round drafts nothing), from a
    generator of its own: a stand-in for `cost`, whose depths follow measured times."""

    def __init__(self, max_depth: int, seed: int):
        self.name, self.max_depth, self._random = f"random:{max_depth}", max_depth, random.Random(seed)

    def start(self, seq_id: int) -> None:
        pass

    def budget(self, seq_id: int) -> Budget:
        depth = self._random.randint(0, self.max_depth)
        return Budget(depth=depth, nodes=depth)

    def observe(self, seq_id, tree, result) -> None:
        pass

    def observe_draft_time(self, seconds: float, depth: int) -> None:
        pass


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    """An independent one-layer draft model with the target's 8 tokens."""
    return load_decoder(make_tiny("llama", tmp_path_factory.mktemp("draft8") / "d", vocab=8, seed=3, layers=1), "cpu")


SEEDED = {  # drafter name -> (make the drafter from (target, draft), tree): samplers first, then lookups
    "self_chain": lambda t, d: ModelDrafter(t, parse_shape("chain"), name="draft-model:self"),
    "early_exit_chain": lambda t, d: ModelDrafter(t, parse_shape("chain"), num_layers=1, name="early-exit:1"),
    "draft_model_chain": lambda t, d: ModelDrafter(d, parse_shape("chain"), name="draft-model:tiny"),
    "ngram": lambda t, d: NgramDrafter(),
    "suffix": lambda t, d: SuffixDrafter(),
}
SAMPLERS = ("self_chain", "early_exit_chain", "draft_model_chain")
DEPTHS = {"fixed:1": lambda: FixedController(1), "fixed:4": lambda: FixedController(4),
          "random:5": lambda: RandomDepths(5, seed=0)}


def seeded_runs(target, draft, plain, name: str, controller: str, verifier: str | None = None):
    """Each SAMPLING's seeded completions of PROMPTS under this drafter and controller (one
    speculator for all, so its state carries over), and plain sampling's tokens with the same seeds."""
    made = DEPTHS[controller]()
    spec = speculator(SEEDED[name](target, draft), "chain", made.max_depth, made, verifier)
    runs = []
    for i, params in enumerate(SAMPLING):
        fast = finished(target, spec, params, 40 + i)
        runs.append((fast, plain[i, 40 + i]))
    return runs


@pytest.mark.parametrize("controller", DEPTHS)
@pytest.mark.parametrize("name", SEEDED)
def test_seeded_speculation_is_the_autoregressive_sample(target, draft, plain, name, controller):
    runs = seeded_runs(target, draft, plain, name, controller)
    for fast, plain in runs:
        assert [f.token_ids for f in fast] == plain
    accepted = sum(sum(f.round_stats.accepted_by_position) for fast, _ in runs for f in fast)
    assert accepted > 10, "too few drafts accepted: the speculative path is not exercised"


def test_coupled_drafts_are_accepted_where_q_is_p(target, draft, plain):
    """The target drafting for itself (q == p): each coupled draft is the token the walk draws
    (up to float32 rounding between the drafter's one-row forwards and the k-row verify), so
    nearly every draft is accepted; drawn from streams of its own it would be accepted with
    probability sum p(x)^2 only."""
    drafted = accepted = 0
    for fast, _ in seeded_runs(target, draft, plain, "self_chain", "fixed:4"):
        for f in fast:
            drafted += f.round_stats.drafted
            accepted += sum(f.round_stats.accepted_by_position)
    assert accepted >= 0.95 * drafted


@pytest.mark.parametrize("name", SAMPLERS)
def test_mutant_check_rejection_sampling_on_the_seeded_path_is_caught(target, draft, plain, name, monkeypatch):
    """The first test's strength: were a seeded request verified by rejection sampling (here the
    engine's choice mutated to ignore the seed), its text would leave the autoregressive sample."""
    from outrider.engine.loop import EngineLoop

    real = EngineLoop._verifier
    monkeypatch.setattr(EngineLoop, "_verifier", lambda self, request, params, speculate: real(
        self, dataclasses.replace(request, params=dataclasses.replace(request.params, seed=None)), params, speculate))
    for controller in DEPTHS:
        runs = seeded_runs(target, draft, plain, name, controller)
        assert any([f.token_ids for f in fast] != plain for fast, plain in runs), controller


def test_a_named_rejection_verifier_depends_on_the_depths(target, draft, plain):
    """Why the walk is the seeded default: rejection sampling's text changes with the draft depth."""
    one = seeded_runs(target, draft, plain, "draft_model_chain", "fixed:1", verifier="rejection_chain")
    four = seeded_runs(target, draft, plain, "draft_model_chain", "fixed:4", verifier="rejection_chain")
    assert [[f.token_ids for f in fast] for fast, _ in one] != [[f.token_ids for f in fast] for fast, _ in four]


def test_three_identical_seeded_requests_on_a_serving_engine(target, draft):
    """serve's case: the first request runs alone for a few rounds, then two more join; depths
    vary round by round (as `cost`'s do under a changing batch): one text, plain sampling's."""
    from outrider.engine.loop import EngineLoop

    made = RandomDepths(5, seed=1)
    spec = speculator(SEEDED["draft_model_chain"](target, draft), "chain", 5, made)
    params = SamplingParams(temperature=0.9, seed=5)
    engine = EngineLoop(target, set(), spec, max_running=4)
    texts = {}
    first = engine.add(Request(list(PROMPTS[0]), 20, params))
    for _ in range(4):
        for event in engine.step():
            if event.completion is not None:
                texts[event.request_id] = event.completion.token_ids
    later = [engine.add(Request(list(PROMPTS[0]), 20, params)) for _ in range(2)]
    while engine.has_work:
        for event in engine.step():
            if event.completion is not None:
                texts[event.request_id] = event.completion.token_ids
    plain = run(target, None, params, 5, [PROMPTS[0]], n=20)[0]
    assert [texts[i] for i in [first, *later]] == [plain] * 3
