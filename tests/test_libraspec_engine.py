"""LibraSpec through the drafters, the engine and the bench (control/libraspec.py).

- The drafters' confidences: suffix count shares and model path probabilities; model chains and
  trees stop drafting below `Budget.min_confidence`.
- Exactness: greedy speculative output equals autoregressive output through the trims (tiny
  models here; SmolLM2 with suffix and the shipped EAGLE-3 head, marked `model`); a chi-square
  test end to end through the engine; seeded tree-walk runs equal plain sampling token for token.
The rule itself and the exact law of trimmed sampled trees: test_libraspec_rule.py.
"""

from dataclasses import replace

import pytest
import torch
from enumerate_law import one_thread
from test_libraspec_rule import STEEP
from tiny import make_tiny

from outrider.control.controllers import FixedController
from outrider.control.libraspec import LibraSpecController, ThresholdController
from outrider.control.profile import VerifyCostProfile
from outrider.drafters.model import ModelDrafter
from outrider.drafters.suffix import SuffixDrafter
from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.sampling import SamplingParams
from outrider.spec.shapes import parse_shape
from outrider.spec.types import Budget, DraftTree
from outrider.weights.loader import load_decoder


# -- the drafters' confidences -----------------------------------------------------------------------
def test_suffix_confidence_is_its_path_probability():
    prompt = [1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 4, 0, 1, 2, 5, 0, 1, 2]  # 3: 0.5, 4 and 5: 0.25
    drafter = SuffixDrafter(alpha=4.0, min_prob=0.1)
    drafter.start(0, prompt)
    tree = drafter.propose(0, prompt, Budget(1, 8))
    assert tree.tokens.tolist() == [2, 3, 4, 5] and tree.confidence.tolist() == [1.0, 0.5, 0.25, 0.25]
    deeper = drafter.propose(0, prompt, Budget(3, 8))
    confidence, parents = deeper.confidence.tolist(), deeper.parents.tolist()
    assert all(confidence[i] <= confidence[parents[i]] for i in range(1, deeper.size))


@pytest.fixture(scope="module")
def target(tiny_folders):
    return load_decoder(tiny_folders["llama"], "cpu")


@pytest.mark.parametrize("shape", ["chain", "static:2,2", "dynamic:3,6"])
def test_model_drafters_give_path_probabilities(target, shape):
    drafter = ModelDrafter(target, parse_shape(shape), num_layers=1, name="early-exit:1")
    prompt = [5, 9, 12, 5, 9]
    drafter.start(0, prompt)
    tree = drafter.propose(0, prompt, Budget(3, 8))
    confidence, parents = tree.confidence.tolist(), tree.parents.tolist()
    assert tree.size > 1 and confidence[0] == pytest.approx(1.0)
    assert all(0.0 < confidence[i] <= confidence[parents[i]] + 1e-6 for i in range(1, tree.size))
    # the first draft's confidence is the one-layer model's softmax share of that token
    cache = target.new_cache(1, 16)
    from outrider.models.batch import pack

    batch = pack([0], [0], [torch.tensor(prompt)], logits="last", scratch_row=cache.scratch_row, device=target.device)
    q = torch.softmax(target.forward(batch, cache, num_layers=1).logits[0, -1].float(), -1)
    assert confidence[1] == pytest.approx(float(q[tree.tokens[1]]), rel=1e-4)


def test_a_model_chain_stops_after_the_first_draft_below_min_confidence(target):
    drafter = ModelDrafter(target, parse_shape("chain"), num_layers=1, name="early-exit:1")
    prompt = [5, 9, 12, 5, 9]
    drafter.start(0, prompt)
    full = drafter.propose(0, prompt, Budget(4, 4))
    assert full.size == 5
    cut = full.confidence.tolist()[2]  # stop after the second draft
    drafter.start(0, prompt)
    short = drafter.propose(0, prompt, Budget(4, 4, min_confidence=cut * (1 + 1e-6)))
    assert short.tokens.tolist() == full.tokens.tolist()[:3]  # that draft is kept, nothing below it


@pytest.mark.parametrize("shape", ["static:2,2,2", "dynamic:2,8"])
def test_model_trees_do_not_grow_below_min_confidence(target, shape):
    drafter = ModelDrafter(target, parse_shape(shape), num_layers=1, name="early-exit:1")
    prompt = [5, 9, 12, 5, 9]
    drafter.start(0, prompt)
    deep = drafter.propose(0, prompt, Budget(3, 8))
    drafter.start(0, prompt)
    shallow = drafter.propose(0, prompt, Budget(3, 8, min_confidence=1.0))  # no draft is certain
    assert int(max(depths_of(deep))) == 3 and int(max(depths_of(shallow))) == 1


def depths_of(tree):
    from outrider.spec.tree import depths

    return depths(tree.parents).tolist()


# -- greedy equality ---------------------------------------------------------------------------------
def prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 96, (7,), generator=g).tolist(), [10, 11, 12, 13, 10, 11, 12, 13, 10, 11]]


def run(target, spec=None, n=16, params=None, texts=None):
    requests = [Request(p, n, params or SamplingParams()) for p in texts or prompts()]
    with one_thread():
        return [f.token_ids for f in generate_ids(target, requests, set(), speculation=spec)], requests


def libraspec(profile=STEEP, depth=6):
    return LibraSpecController(lambda: profile, depth)


CONTROLLERS = {"libraspec": libraspec, "threshold": lambda: ThresholdController(0.3, 6)}


@pytest.fixture(scope="module")
def plain(target) -> list[list[int]]:
    """The target's greedy output on prompts() without drafts: once, for every controller and shape."""
    return run(target)[0]


@pytest.mark.parametrize("controller", CONTROLLERS)
@pytest.mark.parametrize("shape", ["chain", "static:2,2,1", "dynamic:3,8", "suffix"])
def test_greedy_output_is_autoregressive(target, plain, controller, shape):
    if shape == "suffix":
        drafter, shape = SuffixDrafter(), "chain"
    else:
        drafter = ModelDrafter(target, parse_shape(shape), num_layers=1, name="early-exit:1")
    made = CONTROLLERS[controller]()
    spec = Speculator(SpecOptions(drafter.name, shape, "fixed:6"), drafter, made, parse_shape(shape))
    assert run(target, spec)[0] == plain
    if controller == "libraspec":
        assert made.verified < made.drafted  # the rule trimmed something


@pytest.mark.parametrize("controller", CONTROLLERS)
@pytest.mark.parametrize("shape", ["chain", "dynamic:2,6"])
def test_eagle3_greedy_output_is_autoregressive(vocab8, controller, shape):
    """A tiny random EAGLE-3 head (test_spec_sampling_exact's) drafting for the 8-token target."""
    from test_spec_sampling_exact import eagle3_speculator

    fixed = eagle3_speculator(vocab8, shape, 4)
    spec = Speculator(fixed.options, fixed.drafter, CONTROLLERS[controller](), fixed.shape)
    texts = [[3, 4, 5, 3, 4, 5, 3], [1, 2, 6, 7, 1, 2]]
    assert run(vocab8, spec, texts=texts)[0] == run(vocab8, texts=texts)[0]


def test_the_registered_controller_runs_through_the_speculator(tiny_folders, monkeypatch):
    """`Speculator.build` with `libraspec`: the target's profile asked for when first needed."""
    from outrider.control import profile

    asked = []
    monkeypatch.setattr(profile, "load_or_measure", lambda *args, **kw: asked.append(args) or STEEP)
    target = load_decoder(tiny_folders["llama"], "cpu")
    spec = Speculator.build(SpecOptions("early-exit:1", "chain", "libraspec:4"), target, tiny_folders["llama"])
    assert spec.controller.name == "libraspec:4"
    assert run(target, spec)[0] == run(target)[0]
    assert spec.controller.drafted > 0 and len(asked) == 1


# -- sampling end to end -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vocab8(tmp_path_factory):
    from test_spec_sampling_exact import VOCAB

    return load_decoder(make_tiny("llama", tmp_path_factory.mktemp("lib8") / "target", vocab=VOCAB, seed=0), "cpu")


def test_sampled_chains_through_the_engine_follow_the_target_law(vocab8):
    """Early exit, sampled chains (rejection sampling) trimmed by LibraSpec, one request at a time
    (so each round is trimmed on its own drafts): chi-square against the exact law of the first
    three tokens (the bound and pooling of test_spec_sampling_exact)."""
    from collections import Counter

    from test_spec_sampling_exact import BOUND, LENGTH, PROMPT, SEED, chi_square_p_value, exact_law

    params, runs = SamplingParams(temperature=0.8, top_k=6), 300
    controller = libraspec(VerifyCostProfile((1, 2, 3, 4, 8), (1.0, 1.004, 1.02, 1.06, 1.3)), depth=3)
    drafter = ModelDrafter(vocab8, parse_shape("chain"), num_layers=1, name="early-exit:1")
    spec = Speculator(SpecOptions(drafter.name, "chain", "fixed:3", verifier="rejection_chain"), drafter, controller,
                      parse_shape("chain"))  # named: a seeded request would get the walk
    counts, accepted, lengths = Counter(), 0, Counter()
    with one_thread():
        for i in range(runs):
            request = Request(list(PROMPT), LENGTH, replace(params, seed=SEED + i))
            (done,) = generate_ids(vocab8, [request], set(), speculation=spec)
            counts[tuple(done.token_ids[:LENGTH])] += 1
            accepted += sum(done.round_stats.accepted_by_position)
            lengths[len(done.round_stats.proposed_by_position)] += 1
    assert accepted >= runs // 10 and controller.verified < controller.drafted
    assert len(lengths) > 1  # the trimmed chains differ in length from round to round
    assert chi_square_p_value(counts, exact_law(vocab8, params), runs) > BOUND


@pytest.mark.parametrize("drafter", ["suffix", "static:2,2"])
def test_seeded_tree_walk_runs_equal_plain_sampling(target, drafter):
    """Drafts without q are verified by walking the target's own draws: trimmed or not, a seeded
    run commits exactly what plain sampling with that seed commits."""
    if drafter == "suffix":
        made, shape = SuffixDrafter(), "chain"
    else:
        made, shape = ModelDrafter(target, parse_shape(drafter), num_layers=1, name="early-exit:1"), drafter
    params = SamplingParams(temperature=0.8, seed=17)
    plain, _ = run(target, params=params)
    spec = Speculator(SpecOptions(made.name, shape, "fixed:6"), made, libraspec(), parse_shape(shape))
    assert run(target, spec, params=params)[0] == plain


# -- SmolLM2 ------------------------------------------------------------------------------------------
CODE = "def is_prime(n):\n    \"\"\"Return True if n is a prime number.\"\"\"\n    if n < 2:\n        return False\n"


@pytest.mark.model
@pytest.mark.parametrize("drafter, shape", [("suffix", "chain"), ("eagle3", "dynamic:4,12")])  # chains: tiny tests
def test_smollm2_greedy_output_is_autoregressive(smollm2_decoder, smollm2_tokenizer, smollm2_path, drafter, shape):
    from outrider.drafters.eagle3 import Eagle3Drafter
    from outrider.heads.catalog import resolve_head
    from outrider.heads.eagle3.format import load_eagle3

    target = smollm2_decoder
    if drafter == "suffix":
        made = SuffixDrafter()
    elif drafter == "eagle3":
        head = load_eagle3(resolve_head("smollm2-135m-instruct"), target)
        made = Eagle3Drafter(head, parse_shape(shape), head.config.taps(target.config.num_layers), name="eagle3")
    else:
        made = ModelDrafter(target, parse_shape(shape), num_layers=8, name=drafter)
    controller = libraspec(STEEP, 6)
    spec = Speculator(SpecOptions(made.name, shape, "fixed:6"), made, controller, parse_shape(shape))
    prompt = smollm2_tokenizer(CODE + CODE.replace("is_prime", "is_odd"))["input_ids"]
    with torch.inference_mode(), one_thread():
        ar = generate_ids(target, [Request(list(prompt), 24)], set())[0]
        sp = generate_ids(target, [Request(list(prompt), 24)], set(), speculation=spec)[0]
    assert sp.token_ids == ar.token_ids
    assert 0 < controller.verified <= controller.drafted
    if drafter != "suffix":  # the copied code's suffix drafts are all certain: nothing to trim there
        assert controller.verified < controller.drafted
    if drafter != "early-exit:8":  # 8 of SmolLM2's 30 layers hardly ever guess its next token
        assert sum(sp.round_stats.accepted_by_position) > 0


def test_fixed_controllers_keep_every_draft():
    trees = [DraftTree.chain(1, [2, 3]), DraftTree.root_only(4)]
    assert FixedController(4).trim([0, 1], trees, 2) is trees  # the round verifies their trees as drafted


def test_the_seeds_preset_runs_libraspec_beside_its_baselines():
    from outrider.bench.methods import load_config, preset_path

    config = load_config(preset_path("seeds"))
    controllers = {m.spec.controller.partition(":")[0] for m in config.methods if m.spec}
    assert {"fixed", "cost", "threshold", "libraspec"} <= controllers
    assert {"suffix", "eagle3"} <= {m.spec.kind for m in config.methods if m.spec}
    assert {"humaneval", "code-edit"} <= set(config.workloads)
