"""choose_verifier: the right exact verifier per (tree kind, probabilities, sampling), and a
reason instead of a verifier for combinations that cannot be verified exactly."""

import pytest
import torch

from outrider.sampling import SamplingParams
from outrider.spec.random import PositionalRandom
from outrider.spec.types import DraftTree
from outrider.spec.verifiers import VERIFIERS, VerifierChoice, choose_verifier

GREEDY = SamplingParams()
SAMPLE = SamplingParams(temperature=0.8, top_p=0.9)


@pytest.mark.parametrize(
    "tree_kind, gives_probs, sampling, without_replacement, expected",
    [
        ("chain", False, GREEDY, False, "greedy_chain"),
        ("chain", True, GREEDY, False, "greedy_chain"),
        ("tree", True, GREEDY, True, "greedy_tree"),
        ("chain", True, SAMPLE, False, "rejection_chain"),
        ("chain", False, SAMPLE, False, "chain_walk"),
        ("tree", False, SAMPLE, False, "tree_walk"),
        ("tree", True, SAMPLE, False, "multidraft"),
        ("tree", True, SAMPLE, True, "multidraft_without_replacement"),
    ],
)
def test_default_choices(tree_kind, gives_probs, sampling, without_replacement, expected):
    choice = choose_verifier(tree_kind, gives_probs, sampling, without_replacement=without_replacement)
    assert choice.ok and choice.name == expected and choice.verifier is VERIFIERS[expected].verify
    assert expected in choice.reason


@pytest.mark.parametrize(
    "tree_kind, gives_probs, sampling, without_replacement, name, words",
    [
        ("dag", False, GREEDY, False, None, "tree_kind"),
        ("chain", False, SAMPLE, False, "greedy_chain", "temperature 0"),
        ("tree", False, GREEDY, False, "greedy_chain", "only a chain"),
        ("tree", True, SAMPLE, False, "rejection_chain", "only a chain"),
        ("chain", False, SAMPLE, False, "rejection_chain", "draft_probs"),
        ("tree", False, SAMPLE, False, "multidraft", "draft_probs"),
        ("tree", True, SAMPLE, True, "multidraft", "without replacement"),
        ("tree", True, SAMPLE, False, "multidraft_without_replacement", "with replacement"),
        ("chain", True, SAMPLE, False, "typical_acceptance", "no verifier called"),
    ],
)
def test_refusals_say_why(tree_kind, gives_probs, sampling, without_replacement, name, words):
    choice = choose_verifier(tree_kind, gives_probs, sampling, without_replacement=without_replacement, name=name)
    assert not choice.ok and choice.verifier is None and words in choice.reason


def test_named_choice_that_fits():
    choice = choose_verifier("tree", True, SAMPLE, name="tree_walk")
    assert choice.ok and choice.name == "tree_walk"


def test_every_verifier_runs_on_a_chain_of_its_kind():
    tree = DraftTree.chain(0, [1, 2], torch.full((3, 4), 0.25))
    logits = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    for name, entry in VERIFIERS.items():
        params = GREEDY if entry.greedy_only else SAMPLE
        result = entry.verify(tree, logits, params, PositionalRandom(0))
        assert len(result.tokens) == result.num_accepted + 1, name
        assert result.accepted_nodes == list(range(1, result.num_accepted + 1)), name


def test_verifiers_leave_their_arguments_alone():
    probs = torch.softmax(torch.randn(4, 4, generator=torch.Generator().manual_seed(1)), -1)
    tree = DraftTree(torch.tensor([0, 1, 2, 1]), torch.tensor([-1, 0, 0, 1]), probs)
    logits = torch.randn(4, 4, generator=torch.Generator().manual_seed(2))
    before = [t.clone() for t in (tree.tokens, tree.parents, probs, logits)]
    for name, entry in VERIFIERS.items():
        if "tree" not in entry.kinds:
            continue
        entry.verify(tree, logits, GREEDY if entry.greedy_only else SAMPLE, PositionalRandom(0))
        after = (tree.tokens, tree.parents, probs, logits)
        assert all(torch.equal(a, b) for a, b in zip(before, after)), name


def test_siblings_are_drawn_with_replacement_unless_said():
    assert choose_verifier("tree", True, SAMPLE).name == "multidraft"


KNOWN = ("greedy_chain, greedy_tree, greedy_reference, rejection_chain, rejection_chain_reference, chain_walk, "
         "tree_walk, tree_walk_reference, multidraft, multidraft_without_replacement, resispec-lossy, verify-skip-lossy:..., "
         "acceptmoe-lossy:..., edgexpert-lossy:..., s2moe-gate-lossy:...")


@pytest.mark.parametrize(
    "tree_kind, gives_probs, sampling, without_replacement, name, reason",
    [
        ("dag", False, GREEDY, False, None, "tree_kind must be one of ('chain', 'tree'), got 'dag'"),
        ("chain", True, SAMPLE, False, "typical_acceptance", f"no verifier called 'typical_acceptance'; known: {KNOWN}"),
        ("tree", False, GREEDY, False, "greedy_chain", "greedy_chain verifies only a chain, not a tree"),
        ("chain", False, SAMPLE, False, "greedy_tree",
         "greedy_tree is exact only at temperature 0 (got 0.8); use a sampling verifier"),
        ("chain", False, SAMPLE, False, "rejection_chain",
         "rejection_chain needs drafts drawn from draft_probs; this drafter gives none (use tree_walk)"),
        ("tree", True, SAMPLE, True, "multidraft",
         "multidraft assumes siblings drawn with replacement, but this drafter draws them without replacement"),
        ("tree", True, SAMPLE, False, "multidraft_without_replacement",
         "multidraft_without_replacement assumes siblings drawn without replacement, but this drafter draws them "
         "with replacement"),
    ],
)
def test_refusals_word_for_word(tree_kind, gives_probs, sampling, without_replacement, name, reason):
    """What a user reads when a combination is refused (speculator.py raises it as a ConfigError)."""
    choice = choose_verifier(tree_kind, gives_probs, sampling, without_replacement=without_replacement, name=name)
    assert choice == VerifierChoice("" if name is None else name, None, reason)


@pytest.mark.parametrize(
    "tree_kind, gives_probs, sampling, reason",
    [
        ("chain", False, GREEDY, "greedy_chain: exact for a chain of drafts without probabilities, greedy"),
        ("tree", True, GREEDY, "greedy_tree: exact for a tree of drafts drawn from draft_probs, greedy"),
        ("chain", True, SAMPLE, "rejection_chain: exact for a chain of drafts drawn from draft_probs, temperature 0.8"),
        ("tree", False, SAMPLE, "tree_walk: exact for a tree of drafts without probabilities, temperature 0.8"),
    ],
)
def test_choices_word_for_word(tree_kind, gives_probs, sampling, reason):
    choice = choose_verifier(tree_kind, gives_probs, sampling)
    assert choice.ok and choice.reason == reason


# -- a seeded request gets the walk; a verifier that needs q is refused at temperature 0 (issue 38) ----
@pytest.mark.parametrize(
    "tree_kind, gives_probs, sampling, without_replacement, expected",
    [
        ("chain", True, SAMPLE, False, "chain_walk"),
        ("chain", False, SAMPLE, False, "chain_walk"),
        ("tree", True, SAMPLE, False, "tree_walk"),
        ("tree", True, SAMPLE, True, "tree_walk"),
        ("tree", False, SAMPLE, False, "tree_walk"),
        ("chain", True, GREEDY, False, "greedy_chain"),
        ("tree", True, GREEDY, True, "greedy_tree"),
    ],
)
def test_a_seeded_request_gets_the_walk(tree_kind, gives_probs, sampling, without_replacement, expected):
    choice = choose_verifier(tree_kind, gives_probs, sampling, without_replacement=without_replacement, seeded=True)
    assert choice.ok and choice.name == expected and choice.verifier is VERIFIERS[expected].verify


def test_a_named_verifier_wins_over_the_seed():
    choice = choose_verifier("chain", True, SAMPLE, name="rejection_chain", seeded=True)
    assert choice.ok and choice.name == "rejection_chain"


def test_the_walks_are_the_verifiers_that_commit_plain_draws():
    from outrider.spec.verifiers import is_walk

    assert [name for name, entry in VERIFIERS.items() if is_walk(entry.verify)] == \
        ["chain_walk", "tree_walk", "tree_walk_reference"]


@pytest.mark.parametrize("tree_kind, without_replacement, name", [
    ("chain", False, "rejection_chain"), ("chain", False, "rejection_chain_reference"),
    ("tree", False, "multidraft"), ("tree", True, "multidraft_without_replacement"),
    ("tree", True, "resispec-lossy"),
])
def test_a_verifier_that_needs_q_is_refused_when_greedy(tree_kind, without_replacement, name):
    """At temperature 0 every drafter drafts greedily and gives no draft_probs: a verifier that
    needs them would fail each request at its first round, so it is refused up front."""
    choice = choose_verifier(tree_kind, True, GREEDY, without_replacement=without_replacement, name=name)
    assert choice == VerifierChoice(name, None, f"{name} needs drafts drawn from draft_probs, which drafters draw "
                                                f"only when sampling; at temperature 0 use greedy_{tree_kind} "
                                                "(the default)")
