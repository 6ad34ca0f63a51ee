"""Chain rejection sampling is exact: the enumerated law of a whole speculative generation equals
the autoregressive law of the warped target, to 1e-9; a deliberately wrong verifier is caught."""

import pytest
import torch
from enumerate_law import (
    ToyModel,
    autoregressive_law,
    enumerate_law,
    generate,
    generation_law,
    max_law_difference,
    one_round,
    sampled_tree,
)

from outrider.sampling import SamplingParams
from outrider.spec.random import PositionalRandom
from outrider.spec.types import DraftTree, VerifyResult
from outrider.spec.verify_chain import (
    accept_probability,
    draft_distribution,
    residual,
    target_probs,
    verify_chain,
    verify_chain_reference,
)

PROMPT = [0, 1]
LENGTH = 3
TARGET = ToyModel(3, seed=1)
DRAFTER = ToyModel(3, seed=2)
BLIND_DRAFTER = ToyModel(3, seed=3, banned=2)  # q(2) == 0 everywhere: only residuals produce token 2
PARAMS = {
    "t1": SamplingParams(temperature=1.0),
    "t0.7_topk2": SamplingParams(temperature=0.7, top_k=2),
    "t1.5_topp0.8": SamplingParams(temperature=1.5, top_p=0.8),
    "greedy": SamplingParams(temperature=0.0),
}


def chain_law(verify, k, params, drafter=DRAFTER, length=LENGTH):
    return generation_law(PROMPT, length, TARGET, sampled_tree(drafter, [1] * k, False), verify, params)


CASES = [(1, "t1"), (1, "greedy"), (2, "t1"), (2, "t0.7_topk2"), (2, "t1.5_topp0.8"), (2, "greedy")]


@pytest.mark.parametrize("k, params", CASES, ids=[f"k{k}-{p}" for k, p in CASES])
@pytest.mark.parametrize("verify", [verify_chain_reference, verify_chain], ids=["reference", "fast"])
def test_chain_is_exact(verify, k, params):
    law = chain_law(verify, k, PARAMS[params])
    assert max_law_difference(law, autoregressive_law(PROMPT, LENGTH, TARGET, PARAMS[params])) < 1e-9


@pytest.mark.parametrize("verify", [verify_chain_reference, verify_chain], ids=["reference", "fast"])
def test_chain_of_three_is_exact(verify):
    law = chain_law(verify, 3, PARAMS["t0.7_topk2"], length=3)
    assert max_law_difference(law, autoregressive_law(PROMPT, 3, TARGET, PARAMS["t0.7_topk2"])) < 1e-9


@pytest.mark.parametrize("vocab, length", [(4, 3), (3, 4)])
def test_wider_vocabulary_and_longer_output(vocab, length):
    target, drafter, params = ToyModel(vocab, seed=11), ToyModel(vocab, seed=12), PARAMS["t1.5_topp0.8"]
    law = generation_law(PROMPT, length, target, sampled_tree(drafter, [1], False), verify_chain, params)
    assert max_law_difference(law, autoregressive_law(PROMPT, length, target, params)) < 1e-9


@pytest.mark.parametrize("verify", [verify_chain_reference, verify_chain], ids=["reference", "fast"])
def test_drafter_blind_spot_is_filled_by_residuals(verify):
    law = chain_law(verify, 2, PARAMS["t1.5_topp0.8"], drafter=BLIND_DRAFTER)
    expected = autoregressive_law(PROMPT, LENGTH, TARGET, PARAMS["t1.5_topp0.8"])
    assert any(2 in seq for seq in expected)
    assert max_law_difference(law, expected) < 1e-9


@pytest.mark.parametrize("verify", [verify_chain_reference, verify_chain], ids=["reference", "fast"])
def test_target_as_drafter_accepts_everything(verify):
    """p == q up to warp_probs' float32 rounding: every draft is accepted, the residual is (almost) never used."""
    propose = sampled_tree(TARGET, [1, 1], False)
    law = enumerate_law(lambda rng: len(one_round(PROMPT, rng, TARGET, propose, verify, PARAMS["t1"])))
    assert law[3] > 1 - 1e-6


def test_whole_loop_law_equals_composed_round_laws():
    """enumerating the generation loop in one piece gives the composition generation_law uses."""
    params = PARAMS["t1"]
    propose = sampled_tree(DRAFTER, [1], False)
    whole = enumerate_law(lambda rng: generate(PROMPT, 2, rng, TARGET, propose, verify_chain, params))
    assert max_law_difference(whole, chain_law(verify_chain, 1, params, length=2)) < 1e-12


def recovered_from_p(tree, target_logits, params, rng):
    """Wrong on purpose: after a rejection, draws from p instead of the residual."""
    tokens = tree.tokens.tolist()
    p = target_probs(target_logits, params)
    for i in range(len(tokens) - 1):
        if not rng.uniform_below(accept_probability(p[i], tree.draft_probs[i], tokens[i + 1])):
            return VerifyResult(list(range(1, i + 1)), tokens[1 : i + 1] + [rng.categorical(p[i])])
    return VerifyResult(list(range(1, len(tokens))), tokens[1:] + [rng.categorical(p[-1])])


def test_negative_control_wrong_recovery_is_caught():
    law = chain_law(recovered_from_p, 1, PARAMS["t1"])
    assert max_law_difference(law, autoregressive_law(PROMPT, LENGTH, TARGET, PARAMS["t1"])) > 1e-3


def test_accept_probability_guards():
    p = torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64)
    q = torch.tensor([0.0, 0.25, 0.75], dtype=torch.float64)
    assert accept_probability(p, q, 0) == 1.0  # q(x) == 0 (not drawn from q): the limit
    assert accept_probability(p, q, 1) == 1.0
    assert accept_probability(p, q, 2) == 0.0  # outside p's support: never
    assert residual(p, q).tolist() == pytest.approx([2 / 3, 1 / 3, 0.0])
    assert residual(q, q).tolist() == q.tolist()  # no positive part: p itself


def test_undrawable_draft_never_commits_outside_support():
    params = PARAMS["t0.7_topk2"]
    logits = _logits(2)
    p = target_probs(logits, params)
    cut = int(p[0].argmin())
    assert p[0, cut] == 0.0
    q = torch.full((3, 3), 1 / 3, dtype=torch.float64)
    q[0, cut] = 0.0  # the drafter says it could not draw `cut`, yet drafted it
    tree = DraftTree.chain(PROMPT[-1], [cut, 0], q)
    for verify in (verify_chain_reference, verify_chain):
        law = enumerate_law(lambda rng: tuple(verify(tree, logits, params, rng).tokens))
        assert all(seq[0] != cut for seq in law)
    assert all(verify_chain(tree, logits, params, PositionalRandom(s)).tokens[0] != cut for s in range(50))


def _logits(k):
    """Target logits [k+1, vocab] along the path the target itself would take... any fixed rows do."""
    return torch.stack([TARGET.logits(PROMPT + [0] * i) for i in range(k + 1)])


# --- edges the law tests above do not reach (each kills mutants of verify_chain.py) -------------
FAR = 2**40 + 3  # an absolute position float32 cannot hold: offsets must stay integers


@pytest.mark.parametrize("verify", [verify_chain_reference, verify_chain], ids=["reference", "fast"])
def test_root_alone_is_plain_sampling(verify):
    """No drafts (and no draft_probs): the round commits the token plain sampling draws at offset 0."""
    logits = torch.randn(1, 8, generator=torch.Generator().manual_seed(5))
    params = PARAMS["t1"]
    p = target_probs(logits, params)[0]
    drawn = set()
    for seed in range(40):
        rng = PositionalRandom(seed).at(FAR)
        result = verify(DraftTree.root_only(3), logits, params, rng)
        assert result == VerifyResult([], [PositionalRandom(seed).at(FAR).categorical(p)])
        drawn.add(result.tokens[0])
    assert len(drawn) > 3  # the draws do depend on the seed


def _hand_made(p_rows, q_rows, drafts):
    """A chain whose target rows p and draft rows q are given exactly: logits log p (temperature 1)."""
    logits = torch.tensor(p_rows, dtype=torch.float64).log()  # [n, vocab]; log 0 = -inf
    return DraftTree.chain(0, drafts, torch.tensor(q_rows, dtype=torch.float64)), logits


@pytest.mark.parametrize("verify", [verify_chain_reference, verify_chain], ids=["reference", "fast"])
def test_draft_with_q_zero_is_accepted_when_p_is_positive(verify):
    """q(x) == 0 (not really drawn from q): the limit, accept surely when p(x) > 0."""
    tree, logits = _hand_made([[0.5, 0.5, 0.0], [0.25, 0.25, 0.5]], [[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]], [1])
    law = enumerate_law(lambda rng: tuple(verify(tree, logits, PARAMS["t1"], rng).tokens))
    assert law == pytest.approx({(1, 0): 0.25, (1, 1): 0.25, (1, 2): 0.5}, abs=1e-12)


@pytest.mark.parametrize("verify", [verify_chain_reference, verify_chain], ids=["reference", "fast"])
def test_row_without_residual_falls_back_to_p(verify):
    """Row 0 has p == q, yet its draft x has p(x) == q(x) == 0: rejected surely, and the residual of
    p against itself has no mass, so the recovered token comes from p; row 1 (never reached) has
    residual mass, which must not leak into row 0."""
    tree, logits = _hand_made([[0.5, 0.5, 0.0, 0.0], [0.25] * 4, [0.25] * 4],
                              [[0.5, 0.5, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.25] * 4], [2, 0])
    law = enumerate_law(lambda rng: tuple(verify(tree, logits, PARAMS["t1"], rng).tokens))
    assert law == pytest.approx({(0,): 0.5, (1,): 0.5}, abs=1e-12)
    assert {verify(tree, logits, PARAMS["t1"], PositionalRandom(s)).tokens[0] for s in range(30)} == {0, 1}


def test_p_and_q_rows_are_renormalised_in_float64():
    """A float32 softmax sums to 1 only to ~1e-7 in float64; p and q are divided by their sums."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(3))  # float32, as a model gives
    raw = torch.softmax(logits, -1)
    assert (raw.double().sum(-1) - 1).abs().max() > 1e-12  # the rounding this guards against
    for rows in (target_probs(logits, PARAMS["t1"]), draft_distribution(raw)):
        assert rows.dtype == torch.float64 and (rows.sum(-1) - 1).abs().max() < 1e-14
    assert draft_distribution(torch.tensor([1.0, 3.0, 0.0])).tolist() == [0.25, 0.75, 0.0]


def test_sampling_without_draft_probs_says_what_to_use():
    tree = DraftTree.chain(0, [1, 2])  # no draft_probs
    message = "rejection sampling needs draft_probs (use the tree walk for drafters without them)"
    for verify in (verify_chain_reference, verify_chain):
        with pytest.raises(ValueError) as error:
            verify(tree, torch.zeros(3, 4), PARAMS["t1"], PositionalRandom(0))
        assert str(error.value) == message
