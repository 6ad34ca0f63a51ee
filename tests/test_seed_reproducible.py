"""Same seed, same text: whatever the drafter, its state, the controller or the batch (issue 7, item 4).

Randomness is drawn by output position (spec/random.py), so:
- drafters without probabilities (n-gram, suffix, top-k trees) are verified by the tree walk,
  which commits at each position the token plain sampling draws there: with the same seed the
  speculative text *is* the autoregressive text;
- sampled chains (rejection sampling against q) depend on the drafts, so they equal themselves,
  not plain sampling: the same seed and drafter give the same text, call after call.
"""

import pytest
import torch

from enumerate_law import one_thread
from tiny import make_tiny

from outrider import LLM
from outrider.control.controllers import FixedController
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


def speculator(drafter, shape: str, depth: int) -> Speculator:
    return Speculator(SpecOptions(drafter.name, shape, f"fixed:{depth}"), drafter, FixedController(depth),
                      parse_shape(shape))


def finished(target, spec, params: SamplingParams, seed: int, prompts=PROMPTS, n: int = 16):
    p = SamplingParams(params.temperature, params.top_k, params.top_p, seed)
    return generate_ids(target, [Request(list(x), n, p) for x in prompts], set(), speculation=spec)


def run(target, spec, params: SamplingParams, seed: int, prompts=PROMPTS, n: int = 16) -> list[list[int]]:
    return [f.token_ids for f in finished(target, spec, params, seed, prompts, n)]


WALKED = {  # drafters whose drafts are verified by the tree walk: equal to plain sampling
    "ngram": lambda t: speculator(NgramDrafter(), "chain", 4),
    "suffix": lambda t: speculator(SuffixDrafter(), "chain", 6),
    "early_exit_static": lambda t: speculator(ModelDrafter(t, parse_shape("static:2,2,1"), num_layers=1,
                                                           name="early-exit:1"), "static:2,2,1", 3),
    "early_exit_dynamic": lambda t: speculator(ModelDrafter(t, parse_shape("dynamic:3,6"), num_layers=2,
                                                            name="early-exit:2"), "dynamic:3,6", 3),
}


@pytest.mark.parametrize("name", WALKED)
def test_walked_drafts_give_the_autoregressive_sample(target, name):
    spec = WALKED[name](target)
    accepted = 0
    for params in SAMPLING:
        for seed in (1, 2):  # the speculator's state carries over from call to call
            fast = finished(target, spec, params, seed)
            assert [f.token_ids for f in fast] == run(target, None, params, seed)
            accepted += sum(sum(f.round_stats.accepted_by_position) for f in fast)
    assert accepted > 10, "too few drafts accepted: the speculative path is not exercised"


def test_sampled_chain_repeats_itself_whatever_the_batch(target):
    """Rejection sampling with an early-exit chain: deterministic per seed, alone or in any batch."""
    spec = speculator(ModelDrafter(target, parse_shape("chain"), num_layers=1, name="early-exit:1"), "chain", 3)
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
