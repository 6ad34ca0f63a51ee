"""The tree walk is exact for any drafts: well-aimed, random, bad, duplicated; chains and trees;
node-by-node reference and vectorized form alike. Temperature 0 makes it greedy."""

import pytest
import torch
from enumerate_law import (
    ToyModel,
    autoregressive_law,
    enumerate_law,
    fixed_tree,
    generation_law,
    max_law_difference,
    sampled_tree,
)

from outrider.sampling import SamplingParams
from outrider.spec.types import DraftTree, VerifyResult
from outrider.spec.verify_chain import target_probs
from outrider.spec.tree import children
from outrider.spec.verify_tree import verify_chain_walk, verify_tree_walk, verify_tree_walk_reference

PROMPT = [0, 1]
LENGTH = 3
TARGET = ToyModel(3, seed=1)
DRAFTER = ToyModel(3, seed=2)
PARAMS = {
    "t1": SamplingParams(temperature=1.0),
    "t0.7_topk2": SamplingParams(temperature=0.7, top_k=2),
    "t1.5_topp0.8": SamplingParams(temperature=1.5, top_p=0.8),
    "greedy": SamplingParams(temperature=0.0),
}


def drafter_top(ctx, i):
    return int(DRAFTER.logits(ctx).argmax())


PROPOSERS = {  # name -> (proposer, is a chain)
    "drafter_top_chain": (fixed_tree([-1, 0, 1], drafter_top), True),
    "bad_chain": (fixed_tree([-1, 0, 1], lambda ctx, i: int(TARGET.logits(ctx).argmin())), True),
    "sampled_chain": (sampled_tree(DRAFTER, [1, 1], False, probs=False), True),
    "distinct_siblings": (fixed_tree([-1, 0, 0, 1], lambda ctx, i: (ctx[-1] + i) % 3), False),
    "duplicate_siblings": (fixed_tree([-1, 0, 0, 0, 2], lambda ctx, i: (ctx[-1] + i // 2) % 3), False),
    "sampled_tree": (sampled_tree(DRAFTER, [2], False, probs=False), False),
}


@pytest.mark.parametrize("params", PARAMS)
@pytest.mark.parametrize("proposer", PROPOSERS)
def test_reference_walk_is_exact(proposer, params):
    propose, _ = PROPOSERS[proposer]
    law = generation_law(PROMPT, LENGTH, TARGET, propose, verify_tree_walk_reference, PARAMS[params])
    assert max_law_difference(law, autoregressive_law(PROMPT, LENGTH, TARGET, PARAMS[params])) < 1e-9


VECTORIZED = [(name, "t0.7_topk2") for name in PROPOSERS] + [("drafter_top_chain", "t1"), ("distinct_siblings", "t1")]


@pytest.mark.parametrize("proposer, params", VECTORIZED, ids=[f"{a}-{b}" for a, b in VECTORIZED])
def test_vectorized_walk_is_exact(proposer, params):
    propose, chain = PROPOSERS[proposer]
    verifiers = [verify_tree_walk, verify_chain_walk] if chain else [verify_tree_walk]
    expected = autoregressive_law(PROMPT, LENGTH, TARGET, PARAMS[params])
    for verify in verifiers:
        law = generation_law(PROMPT, LENGTH, TARGET, propose, verify, PARAMS[params])
        assert max_law_difference(law, expected) < 1e-9


def test_all_siblings_mean_the_first_draft_is_always_accepted():
    tree = DraftTree(torch.tensor([1, 0, 1, 2]), torch.tensor([-1, 0, 0, 0]))
    logits = torch.stack([TARGET.logits(PROMPT)] + [TARGET.logits(PROMPT + [t]) for t in range(3)])
    for verify in (verify_tree_walk_reference, verify_tree_walk):
        law = enumerate_law(lambda rng: verify(tree, logits, PARAMS["t1"], rng).num_accepted)
        assert law == pytest.approx({1: 1.0})


def peeking_walk(tree, target_logits, params, rng):
    """Wrong on purpose: draws at every node first, then follows the longest path whose drafts
    all match the draws (so among duplicate siblings it picks by peeking at the draws below)."""
    choice = rng.categorical_rows(target_probs(target_logits, params)).tolist()
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    paths = [[]]
    for i in range(1, len(tokens)):
        parent_path = paths[parents[i]]
        ok = parent_path is not None and tokens[i] == choice[parents[i]]
        paths.append(parent_path + [i] if ok else None)
    best = max((p for p in paths if p is not None), key=len)
    leaf = best[-1] if best else 0
    return VerifyResult(best, [tokens[i] for i in best] + [choice[leaf]])


def wrong_bonus(tree, target_logits, params, rng):
    """Wrong on purpose: commits the first child's token when nothing matched."""
    result = verify_tree_walk_reference(tree, target_logits, params, rng)
    node = result.accepted_nodes[-1] if result.accepted_nodes else 0
    kids = children(tree.parents.tolist())[node]
    if not kids:
        return result
    return VerifyResult(result.accepted_nodes, result.tokens[:-1] + [int(tree.tokens[kids[0]])])


# Two duplicate siblings (nodes 1 and 2) with different children (nodes 3 and 4).
DUPLICATES_APART = fixed_tree([-1, 0, 0, 1, 2], lambda ctx, i: (ctx[-1] + (0, 0, 0, 1, 2)[i]) % 3)


@pytest.mark.parametrize("wrong", [peeking_walk, wrong_bonus])
def test_negative_control_wrong_walk_is_caught(wrong):
    law = generation_law(PROMPT, LENGTH, TARGET, DUPLICATES_APART, wrong, PARAMS["t1"])
    assert max_law_difference(law, autoregressive_law(PROMPT, LENGTH, TARGET, PARAMS["t1"])) > 1e-3


def test_duplicates_apart_are_exact_with_the_real_walk():
    expected = autoregressive_law(PROMPT, LENGTH, TARGET, PARAMS["t1"])
    for verify in (verify_tree_walk_reference, verify_tree_walk):
        law = generation_law(PROMPT, LENGTH, TARGET, DUPLICATES_APART, verify, PARAMS["t1"])
        assert max_law_difference(law, expected) < 1e-9
