"""Greedy verification: the vectorized walks agree with the node-by-node reference, and a whole
speculative generation commits exactly the target's greedy tokens, for good drafts and bad."""

import pytest
import torch
from enumerate_law import ToyModel, autoregressive_law, fixed_tree, generation_law, sampled_tree

from outrider.sampling import SamplingParams
from outrider.spec.types import DraftTree
from outrider.spec.verify_greedy import verify_greedy_chain, verify_greedy_reference, verify_greedy_tree

PROMPT = [0, 1]
TARGET = ToyModel(3, seed=1)
DRAFTER = ToyModel(3, seed=2)


def random_case(gen: torch.Generator, chain: bool, vocab: int = 4):
    """Random logits [n, vocab] and a tree whose drafts often equal their parent's argmax."""
    n = int(torch.randint(1, 9, (), generator=gen))
    logits = torch.randn(n, vocab, generator=gen)  # [n, vocab]
    best = logits.argmax(-1)
    if chain:
        parents = list(range(-1, n - 1))
    else:
        parents = [-1] + [int(torch.randint(0, i, (), generator=gen)) for i in range(1, n)]
    tokens = [0]
    for i in range(1, n):
        lucky = float(torch.rand((), generator=gen)) < 0.6
        tokens.append(int(best[parents[i]]) if lucky else int(torch.randint(0, vocab, (), generator=gen)))
    return DraftTree(torch.tensor(tokens), torch.tensor(parents)), logits


def test_fast_chain_matches_reference():
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        tree, logits = random_case(gen, chain=True)
        expected = verify_greedy_reference(tree, logits)
        assert verify_greedy_chain(tree, logits) == expected
        assert verify_greedy_tree(tree, logits) == expected


def test_fast_tree_matches_reference():
    gen = torch.Generator().manual_seed(1)
    accepted = 0
    for _ in range(500):
        tree, logits = random_case(gen, chain=False, vocab=3)  # vocab 3: many duplicate siblings
        result = verify_greedy_tree(tree, logits)
        assert result == verify_greedy_reference(tree, logits)
        accepted += result.num_accepted
    assert accepted > 300  # the cases do exercise deep paths


def test_duplicate_siblings_take_the_first():
    # node 1 and node 2 both carry the root's argmax (token 2); node 3 hangs under node 2.
    tree = DraftTree(torch.tensor([0, 2, 2, 1]), torch.tensor([-1, 0, 0, 2]))
    logits = torch.tensor([[0.0, 0.0, 5.0], [0.0, 5.0, 0.0], [0.0, 5.0, 0.0], [5.0, 0.0, 0.0]])
    for verify in (verify_greedy_reference, verify_greedy_tree):
        result = verify(tree, logits)
        assert (result.accepted_nodes, result.tokens) == ([1], [2, 1])


GREEDY = [SamplingParams(), SamplingParams(top_k=2, top_p=0.5)]
PROPOSERS = {
    "drafter_chain": sampled_tree(DRAFTER, [1, 1], without_replacement=False),
    "drafter_tree": sampled_tree(DRAFTER, [2, 1], without_replacement=True),
    "target_argmax_chain": fixed_tree([-1, 0, 1], lambda ctx, i: int(TARGET.logits(ctx).argmax())),
    "bad_chain": fixed_tree([-1, 0, 1, 2], lambda ctx, i: int(TARGET.logits(ctx).argmin())),
    "duplicates_tree": fixed_tree([-1, 0, 0, 0, 2], lambda ctx, i: (i // 2 + ctx[-1]) % 3),
}


@pytest.mark.parametrize("params", GREEDY, ids=["greedy", "greedy_topk_topp"])
@pytest.mark.parametrize("proposer", PROPOSERS)
def test_generation_is_the_greedy_sequence(proposer, params):
    verify = verify_greedy_chain if "chain" in proposer else verify_greedy_tree
    law = generation_law(PROMPT, 4, TARGET, PROPOSERS[proposer], verify, params)
    expected = autoregressive_law(PROMPT, 4, TARGET, params)
    assert len(expected) == 1 and set(law) == set(expected)
    assert abs(sum(law.values()) - 1.0) < 1e-12



def test_deep_paths_are_checked_to_the_root():
    """follow_tree's pointer doubling must reach every ancestor. Chains of up to 34 nodes (n - 1 a
    power of two and one past it included), the first mismatch at every depth or none, each node
    also given a decoy child (token 0, never chosen): the vectorized walk agrees with the reference."""
    for n in (2, 3, 4, 5, 6, 9, 10, 17, 18, 33, 34):
        for bad in range(1, n + 1):  # bad == n: the whole chain is accepted
            tokens = [0] + [1 if i != bad else 2 for i in range(1, n)] + [0] * (n - 1)
            parents = list(range(-1, n - 1)) + list(range(n - 1))
            tree = DraftTree(torch.tensor(tokens), torch.tensor(parents))
            logits = torch.nn.functional.one_hot(torch.ones(len(tokens), dtype=torch.long), 3).float()  # choice 1
            result = verify_greedy_tree(tree, logits)
            assert result == verify_greedy_reference(tree, logits) and result.num_accepted == bad - 1


def test_the_registered_greedy_verifiers_give_the_same_result_from_host_choices():
    """greedy_chain and greedy_tree are GreedyVerifiers: alone they read their own argmax; a round
    hands them their rows' argmax read for the whole batch (from_choices), with the same result."""
    from outrider.spec.verifiers import VERIFIERS
    from outrider.spec.verify_greedy import GreedyVerifier

    gen = torch.Generator().manual_seed(2)
    for name, chain in (("greedy_chain", True), ("greedy_tree", True), ("greedy_tree", False)):
        verify = VERIFIERS[name].verify
        assert isinstance(verify, GreedyVerifier)
        for _ in range(100):
            tree, logits = random_case(gen, chain=chain)
            assert verify.from_choices(tree, logits.argmax(-1).tolist()) == verify(tree, logits)
