"""LibraSpec's trims (control/libraspec_trim.py) and options: the rule and exactness by law.

- The rule: at batch 1 the kept length maximises expected tokens per second among best-first
  prefixes (the paper's "converges to the optimal length"), for random falling gains and convex
  costs; trees without confidence are verified whole; a batch fills the padding for free;
  trimmed trees stay valid, their draft_probs and confidence rows kept with their nodes.
- Options: bad `libraspec`/`threshold` arguments are refused in one line before the model loads.
- Exactness: the exact output law of sampled chains and sampled sibling trees (multi-draft, both
  modes) trimmed by LibraSpec and by the threshold equals the target's within 1e-9, while a trim
  that looks at a sampled node's own probability is caught (> 1e-3: the negative control).
Through the drafters and the engine: test_libraspec_engine.py (it imports STEEP from here).
"""

from dataclasses import replace

import pytest
import torch
from enumerate_law import (
    ToyModel,
    autoregressive_law,
    generation_law,
    max_law_difference,
    sampled_tree,
)

from outrider.control.controllers import parse_controller
from outrider.control.libraspec_trim import Offer, marginal_trim, subtree, threshold_trim
from outrider.control.profile import VerifyCostProfile
from outrider.engine.speculator import SpecOptions
from outrider.errors import ConfigError
from outrider.sampling import SamplingParams
from outrider.spec.tree import tree_problem
from outrider.spec.types import Budget, DraftTree
from outrider.spec.verify_chain import verify_chain_reference
from outrider.spec.verify_multidraft import MultiDraftVerifier


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
