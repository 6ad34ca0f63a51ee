"""LibraSpec (control/libraspec.py): the marginal rule, the drafters' confidences, and exactness.

- The rule: at batch 1 the kept length maximises expected tokens per second among best-first
  prefixes (the paper's "converges to the optimal length"), for random falling gains and convex
  costs; trees without confidence are verified whole; a batch fills the padding for free;
  trimmed trees stay valid, their draft_probs and confidence rows kept with their nodes.
- Exactness: greedy speculative output equals autoregressive output through the trims (tiny
  models here; SmolLM2 with suffix, the shipped EAGLE-3 head and early exit, marked `model`);
  the exact output law of sampled chains and sampled sibling trees (multi-draft, both modes)
  trimmed by LibraSpec and by the threshold equals the target's within 1e-9, while a trim that
  looks at a sampled node's own probability is caught (> 1e-3: the negative control); a chi-square
  test end to end through the engine; seeded tree-walk runs equal plain sampling token for token.
"""

from dataclasses import replace

import pytest
import torch
from enumerate_law import (
    ToyModel,
    autoregressive_law,
    generation_law,
    max_law_difference,
    one_thread,
    sampled_tree,
)
from tiny import make_tiny

from outrider.control.controllers import FixedController, parse_controller
from outrider.control.libraspec import (
    LibraSpecController,
    Offer,
    ThresholdController,
    marginal_trim,
    subtree,
    threshold_trim,
)
from outrider.control.profile import VerifyCostProfile
from outrider.drafters.base import Budget
from outrider.drafters.model import ModelDrafter
from outrider.drafters.suffix import SuffixDrafter
from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.errors import ConfigError
from outrider.sampling import SamplingParams
from outrider.spec.shapes import parse_shape
from outrider.spec.tree import tree_problem
from outrider.spec.types import DraftTree
from outrider.spec.verify_chain import verify_chain_reference
from outrider.spec.verify_multidraft import MultiDraftVerifier
from outrider.weights.loader import load_decoder

# a verify cost that grows fast enough for the rule to trim at everyday confidences
STEEP = VerifyCostProfile((1, 2, 3, 4, 6, 8, 16, 32), (1.0, 1.1, 1.25, 1.45, 1.9, 2.4, 4.4, 8.4))


def chain(confidence: list[float], probs: torch.Tensor | None = None) -> DraftTree:
    tree = DraftTree.chain(0, list(range(1, len(confidence))), probs)
    return replace(tree, confidence=torch.tensor(confidence, dtype=torch.float64))


def rate(gains: list[float], n: int, cost, draft_s: float) -> float:
    return (1 + sum(gains[:n])) / (draft_s + cost(1 + n))


# -- the rule ---------------------------------------------------------------------------------------
def test_a_chain_is_cut_where_the_next_draft_stops_paying():
    tree = chain([1.0, 0.9, 0.8, 0.5, 0.1, 0.05])
    (kept,) = marginal_trim([tree], 1, STEEP.cost, 0.0)
    # E/T: 1/1, 1.9/1.1, 2.7/1.25, 3.2/1.45, 3.3/1.675, ...: the best is 3 drafts (2.207 a second)
    assert kept.tokens.tolist() == [0, 1, 2, 3] and kept.confidence.tolist() == [1.0, 0.9, 0.8, 0.5]
    (free,) = marginal_trim([tree], 1, lambda n: 1.0, 0.0)  # verifying more costs nothing: keep all
    assert free.size == tree.size
    (dear,) = marginal_trim([tree], 1, lambda n: float(n), 0.0)  # each token a whole forward: none pays
    assert dear.size == 1


@pytest.mark.parametrize("seed", range(40))
def test_the_kept_length_is_the_best_one(seed):
    """Falling gains, convex verify cost, some drafting time: the marginal rule stops at the
    length of the highest expected tokens per second (brute force over every length)."""
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 12, (1,), generator=g))
    shares = (0.3 + 0.7 * torch.rand(n, generator=g, dtype=torch.float64)).tolist()
    confidence = [1.0]
    for share in shares:
        confidence.append(confidence[-1] * share)
    slopes = torch.rand(n + 2, generator=g, dtype=torch.float64).sort().values * 0.4  # rising: convex
    table = [1.0]
    for s in slopes.tolist():
        table.append(table[-1] + s)
    cost = lambda width: table[width - 1]  # noqa: E731
    draft_s = float(torch.rand(1, generator=g)) * 0.5
    (kept,) = marginal_trim([chain(confidence)], 1, cost, draft_s)
    best = max(range(n + 1), key=lambda k: rate(confidence[1:], k, cost, draft_s))
    assert kept.size - 1 == best


def test_a_tree_keeps_its_best_nodes_first():
    #   0 -> 1 (0.6) -> 3 (0.5) ;  0 -> 2 (0.28) -> 4 (0.25)
    tree = DraftTree(torch.tensor([9, 5, 6, 7, 8]), torch.tensor([-1, 0, 0, 1, 2]),
                     confidence=torch.tensor([1.0, 0.6, 0.28, 0.5, 0.25]))
    (kept,) = marginal_trim([tree], 1, lambda n: 1.0 + 0.2 * (n - 1), 0.0)
    # node 1: 0.6 * 1.0 >= 1 * 0.2; node 3: 0.5 * 1.2 >= 1.6 * 0.2; node 2: 0.28 * 1.4 < 2.1 * 0.2
    assert kept.tokens.tolist() == [9, 5, 7] and kept.parents.tolist() == [-1, 0, 1]
    (low,) = threshold_trim([tree], 0.27)
    assert low.tokens.tolist() == [9, 5, 6, 7] and low.parents.tolist() == [-1, 0, 0, 1]  # renumbered


def test_trees_without_confidence_are_verified_whole_and_pad_the_batch():
    plain = DraftTree.chain(0, [1, 2, 3, 4])  # no confidence (ngram): kept whole, width 5
    weak = chain([1.0, 0.2, 0.1, 0.05])
    cost = lambda width: 1.0 + 0.5 * (width - 1)  # noqa: E731
    alone = marginal_trim([weak], 1, cost, 0.0)[0]
    together = marginal_trim([plain, weak], 2, cost, 0.0)
    assert alone.size == 1  # alone, no draft of weak pays for its verify cost
    assert together[0] is plain and together[1].size == 4  # beside plain, they fit in its padding


def test_a_batch_widens_for_all_sequences_at_once():
    """One forward padded to the widest tree: a widening that pays for one sequence's strong
    drafts carries the other's weak ones along (they fill the padding)."""
    strong, weak = chain([1.0, 0.9, 0.8]), chain([1.0, 0.05, 0.01])
    cost = lambda width: 1.0 + 0.3 * (width - 1)  # noqa: E731
    assert marginal_trim([weak], 1, cost, 0.0)[0].size == 1
    # widening to 2: (0.9 + 0.05) * 1.0 >= 2 * 0.3; to 3: (0.8 + 0.01) * 1.3 >= 2.95 * 0.3
    assert [t.size for t in marginal_trim([strong, weak], 2, cost, 0.0)] == [3, 3]


def test_subtree_keeps_rows_with_their_nodes():
    probs = torch.rand(5, 7)
    tree = DraftTree(torch.tensor([9, 5, 6, 7, 8]), torch.tensor([-1, 0, 0, 1, 2]), probs,
                     torch.tensor([1.0, 0.6, 0.3, 0.5, 0.25], dtype=torch.float64))
    kept = subtree(tree, [0, 2, 4])
    assert kept.tokens.tolist() == [9, 6, 8] and kept.parents.tolist() == [-1, 0, 1]
    assert torch.equal(kept.draft_probs, probs[[0, 2, 4]]) and kept.confidence.tolist() == [1.0, 0.3, 0.25]
    assert tree_problem(kept.tokens, kept.parents, kept.draft_probs, 10) is None
    assert subtree(tree, list(range(5))) is tree


def test_a_sampled_tree_is_judged_before_its_draws():
    """With q, a node's gain is its parent's confidence times the chance a draw from the
    parent's row is right (E_q q = Σ q²), whatever token was drawn; siblings go together."""
    q = torch.tensor([0.7, 0.2, 0.1, 0.0])
    probs = torch.stack([q, q, q])
    likely = DraftTree.chain(0, [0, 0], probs)  # drew the likely token twice: q = 0.7, 0.7
    unlikely = DraftTree.chain(0, [2, 2], probs)  # drew the unlikely one: q = 0.1, 0.1
    first = [Offer(with_confidence(t)) for t in (likely, unlikely)]
    assert first[0].best == first[1].best and first[0].best.gain == pytest.approx(0.54)  # 0.49 + 0.04 + 0.01
    for offer in first:
        offer.take()
    assert first[0].best.gain == pytest.approx(0.7 * 0.54) and first[1].best.gain == pytest.approx(0.1 * 0.54)
    family = DraftTree(torch.tensor([0, 1, 0]), torch.tensor([-1, 0, 0]), probs, torch.tensor([1.0, 0.2, 0.7]))
    offer = Offer(family)
    assert offer.best.nodes == (1, 2) and offer.best.gain == pytest.approx(1 - 0.46 ** 2)


# -- options --------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, message", [
    ("libraspec:0", "libraspec:MAX takes a maximum depth from 1 to 64, got '0'"),
    ("libraspec:x", "libraspec:MAX takes a maximum depth from 1 to 64, got 'x'"),
    ("libraspec:65", "libraspec:MAX takes a maximum depth from 1 to 64, got '65'"),
    ("threshold", "threshold:T[,MAX] takes a confidence T in (0, 1], got ''"),
    ("threshold:0", "threshold:T[,MAX] takes a confidence T in (0, 1], got '0'"),
    ("threshold:x", "threshold:T[,MAX] takes a confidence T in (0, 1], got 'x'"),
    ("threshold:0.5,0", "threshold:T,MAX takes a maximum depth from 1 to 64, got '0'"),
])
def test_bad_options_are_refused_in_one_line(text, message):
    with pytest.raises(ConfigError) as error:
        SpecOptions("suffix", controller=text).check()
    assert str(error.value) == f"--controller {text!r}: {message}"


def test_options_build_the_controllers():
    assert parse_controller("libraspec").max_depth == 8 and parse_controller("libraspec:12").name == "libraspec:12"
    threshold = parse_controller("threshold:0.3,6")
    assert (threshold.name, threshold.threshold, threshold.max_depth) == ("threshold:0.3,6", 0.3, 6)
    assert threshold.budgets([1, 2], 2, lambda d: 2 * d) == [Budget(6, 12, 0.3)] * 2
    with pytest.raises(ConfigError, match="verify-cost profile"):
        parse_controller("libraspec", profile_factory=lambda: None).trim([0], [chain([1.0, 0.5])], 1)


def test_bad_options_fail_before_the_model_loads(capsys):
    from outrider.cli import main

    assert main(["generate", "--model", "no-such-model", "--drafter", "suffix", "--controller", "libraspec:x",
                 "hi"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert lines == ["error: --controller 'libraspec:x': libraspec:MAX takes a maximum depth from 1 to 64, got 'x'"]


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


@pytest.mark.parametrize("controller", CONTROLLERS)
@pytest.mark.parametrize("shape", ["chain", "static:2,2,1", "dynamic:3,8", "suffix"])
def test_greedy_output_is_autoregressive(target, controller, shape):
    if shape == "suffix":
        drafter, shape = SuffixDrafter(), "chain"
    else:
        drafter = ModelDrafter(target, parse_shape(shape), num_layers=1, name="early-exit:1")
    made = CONTROLLERS[controller]()
    spec = Speculator(SpecOptions(drafter.name, shape, "fixed:6"), drafter, made, parse_shape(shape))
    plain, _ = run(target)
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


# -- the output law of trimmed sampled trees ------------------------------------------------------------
LAW_TARGET, LAW_DRAFTER, LAW_PROMPT = ToyModel(3, seed=1), ToyModel(3, seed=2), [0, 1]
T1 = SamplingParams(temperature=1.0)


def with_confidence(tree: DraftTree) -> DraftTree:
    """The path probability of each node under the q rows that drew it."""
    parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
    confidence = [1.0]
    for i in range(1, tree.size):
        confidence.append(confidence[parents[i]] * float(tree.draft_probs[parents[i], tokens[i]]))
    return replace(tree, confidence=torch.tensor(confidence, dtype=torch.float64))


def trimmed(propose, trim):
    return lambda committed, rng: trim(with_confidence(propose(committed, rng)))


def libraspec_trim(tree):
    return marginal_trim([tree], 1, lambda n: 1.0 + 0.25 * (n - 1) ** 1.5, 0.1)[0]


def own_probability_trim(tree):
    """Broken on purpose: keeps the nodes whose own path confidence reaches 0.3, as for a tree
    without q (the confidences fall along a path, so the kept nodes are closed under parents)."""
    return subtree(tree, [i for i, c in enumerate(tree.confidence.tolist()) if c >= 0.3])


def law_error(widths, without_replacement, trim, verify, length=3):
    propose = trimmed(sampled_tree(LAW_DRAFTER, widths, without_replacement), trim)
    law = generation_law(LAW_PROMPT, length, LAW_TARGET, propose, verify, T1)
    return max_law_difference(law, autoregressive_law(LAW_PROMPT, length, LAW_TARGET, T1))


TRIMS = {"libraspec": libraspec_trim, "threshold": lambda tree: threshold_trim([tree], 0.3)[0]}


@pytest.mark.parametrize("trim", TRIMS)
def test_trimmed_sampled_chains_keep_the_target_law(trim):
    assert law_error([1, 1, 1], False, TRIMS[trim], verify_chain_reference) < 1e-9


@pytest.mark.parametrize("trim", TRIMS)
@pytest.mark.parametrize("without_replacement", [False, True], ids=["with_replacement", "without_replacement"])
def test_trimmed_sampled_siblings_keep_the_target_law(trim, without_replacement):
    verify = MultiDraftVerifier(without_replacement)
    assert law_error([2, 1], without_replacement, TRIMS[trim], verify, length=2) < 1e-9


def test_negative_control_trimming_a_draw_for_its_own_probability_is_caught():
    assert law_error([1, 1, 1], False, own_probability_trim, verify_chain_reference) > 1e-3
    assert law_error([2, 1], False, own_probability_trim, MultiDraftVerifier(False), length=2) > 1e-3


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
    spec = Speculator(SpecOptions(drafter.name, "chain", "fixed:3"), drafter, controller, parse_shape("chain"))
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
    from outrider.heads.eagle3_format import load_eagle3

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


def test_fixed_controllers_have_no_trim():
    assert not hasattr(FixedController(4), "trim")  # the speculator verifies their trees as drafted


def test_the_seeds_preset_runs_libraspec_beside_its_baselines():
    from outrider.bench.methods import load_config, preset_path

    config = load_config(preset_path("seeds"))
    controllers = {m.spec.controller.partition(":")[0] for m in config.methods if m.spec}
    assert {"fixed", "cost", "threshold", "libraspec"} <= controllers
    assert {"suffix", "eagle3"} <= {m.spec.kind for m in config.methods if m.spec}
    assert {"humaneval", "code-edit"} <= set(config.workloads)
