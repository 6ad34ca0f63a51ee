"""Multi-draft recursive rejection sampling is exact in both modes (siblings drawn with and
without replacement), including degenerate drafters; verifying in the wrong mode is caught."""

import pytest
import torch
from enumerate_law import (
    ToyModel,
    autoregressive_law,
    generation_law,
    max_law_difference,
    sampled_tree,
    target_logits,
)

from outrider.sampling import SamplingParams
from outrider.spec.random import PositionalRandom
from outrider.spec.types import DraftTree
from outrider.spec.verify_chain import verify_chain_reference
from outrider.spec.verify_multidraft import MultiDraftVerifier

PROMPT = [0, 1]
LENGTH = 3
TARGET = ToyModel(3, seed=1)
DRAFTER = ToyModel(3, seed=2)
BLIND_DRAFTER = ToyModel(3, seed=3, banned=2)  # q(2) == 0 everywhere
PARAMS = {
    "t1": SamplingParams(temperature=1.0),
    "t0.7_topk2": SamplingParams(temperature=0.7, top_k=2),
    "t1.5_topp0.8": SamplingParams(temperature=1.5, top_p=0.8),
    "greedy": SamplingParams(temperature=0.0),
}
WITH = MultiDraftVerifier(without_replacement=False)
WITHOUT = MultiDraftVerifier(without_replacement=True)


class OneHotDrafter:
    """A drafter that always proposes its top token, and says so: q is one-hot."""

    def probs(self, context):
        return torch.nn.functional.one_hot(DRAFTER.logits(context).argmax(), 3).double()


def law_error(widths, without_replacement, verify, params, drafter=DRAFTER, length=LENGTH):
    propose = sampled_tree(drafter, widths, without_replacement)
    law = generation_law(PROMPT, length, TARGET, propose, verify, PARAMS[params])
    return max_law_difference(law, autoregressive_law(PROMPT, length, TARGET, PARAMS[params]))


# (widths, params, length): depth-1 trees over three committed tokens (several rounds); depth-2
# trees, whose draft laws are larger, over two.
CASES = [
    ([2], "t1", 3), ([3], "t1", 3), ([2], "t0.7_topk2", 3), ([3], "t1.5_topp0.8", 3), ([2], "greedy", 3),
    ([2, 1], "t1", 2), ([1, 2], "t1", 2), ([2, 1], "t0.7_topk2", 2), ([2, 1], "t1.5_topp0.8", 2),
]  # fmt: skip


@pytest.mark.parametrize("widths, params, length", CASES, ids=[f"{w}-{p}-L{n}" for w, p, n in CASES])
@pytest.mark.parametrize("without_replacement", [False, True], ids=["with_replacement", "without_replacement"])
def test_multidraft_is_exact(without_replacement, widths, params, length):
    verify = MultiDraftVerifier(without_replacement)  # built here: the mode is the constructor's argument
    assert law_error(widths, without_replacement, verify, params, length=length) < 1e-9


@pytest.mark.parametrize("verify", [WITH, WITHOUT], ids=["with_replacement", "without_replacement"])
def test_two_siblings_at_two_depths(verify):
    """Widths [2, 2] (7 nodes); a drafter with two live tokens keeps the number of trees small."""
    assert law_error([2, 2], verify.without_replacement, verify, "t1", drafter=BLIND_DRAFTER) < 1e-9


@pytest.mark.parametrize("verify", [WITH, WITHOUT], ids=["with_replacement", "without_replacement"])
@pytest.mark.parametrize("params", ["t1", "t0.7_topk2"])
def test_drafter_blind_spot(verify, params):
    """q(2) == 0: token 2 only ever comes from a residual; with 2 siblings w/o replacement q runs out."""
    assert law_error([2], verify.without_replacement, verify, params, drafter=BLIND_DRAFTER) < 1e-9


@pytest.mark.parametrize("params", ["t1", "t1.5_topp0.8"])
def test_one_hot_drafter_with_replacement(params):
    """Identical siblings: the first rejection leaves p(x) == 0, so the rest are rejected too."""
    assert law_error([3], False, WITH, params, drafter=OneHotDrafter()) < 1e-9


@pytest.mark.parametrize("verify", [WITH, WITHOUT], ids=["with_replacement", "without_replacement"])
def test_target_as_drafter(verify):
    """p == q up to float32 rounding: the residual has (almost) no mass and is (almost) never used."""
    assert law_error([2], verify.without_replacement, verify, "t1", drafter=TARGET) < 1e-9


def test_on_a_chain_it_is_rejection_sampling():
    propose = sampled_tree(DRAFTER, [1, 1], False)
    laws = [generation_law(PROMPT, LENGTH, TARGET, propose, v, PARAMS["t1"]) for v in (WITH, WITHOUT, verify_chain_reference)]
    assert max_law_difference(laws[0], laws[2]) < 1e-12 and max_law_difference(laws[1], laws[2]) < 1e-12


@pytest.mark.parametrize("widths, length", [([2], 3), ([3], 3), ([2, 1], 2)])
def test_negative_control_wrong_mode_is_caught(widths, length):
    assert law_error(widths, True, MultiDraftVerifier(False), "t1", length=length) > 1e-3
    assert law_error(widths, False, MultiDraftVerifier(True), "t1", length=length) > 1e-3


@pytest.mark.parametrize("without_replacement", [False, True], ids=["with_replacement", "without_replacement"])
def test_on_a_chain_it_is_rejection_sampling_seed_by_seed(without_replacement):
    """With the production rng, on a chain, both modes make the reference chain verifier's decisions
    from the same draws: the token after the accepted drafts is drawn at its own position (the
    number accepted), not at offset 0, whose draw the round did not consult."""
    verify, propose = MultiDraftVerifier(without_replacement), sampled_tree(DRAFTER, [1, 1, 1], False)
    accepted = 0
    for seed in range(60):
        rng = PositionalRandom(seed).at(len(PROMPT))
        tree = propose(PROMPT, rng)
        logits = target_logits(PROMPT, tree, TARGET)
        result = verify(tree, logits, PARAMS["t1"], rng)
        assert result == verify_chain_reference(tree, logits, PARAMS["t1"], rng), seed
        accepted += result.num_accepted > 0
    assert accepted > 20  # rounds that accept a draft, where the draw's position matters


def test_sampling_without_draft_probs_says_what_to_use():
    tree = DraftTree(torch.tensor([0, 1, 2]), torch.tensor([-1, 0, 0]))  # siblings, no draft_probs
    for verify in (MultiDraftVerifier(False), MultiDraftVerifier(True)):
        with pytest.raises(ValueError) as error:
            verify(tree, torch.zeros(3, 4), PARAMS["t1"], PositionalRandom(0))
        assert str(error.value) == "multi-draft rejection sampling needs draft_probs (use the tree walk without them)"
    root = DraftTree.root_only(0)  # no siblings to test: nothing needs q
    assert MultiDraftVerifier(True)(root, torch.zeros(1, 4), PARAMS["t1"], PositionalRandom(0)).num_accepted == 0
