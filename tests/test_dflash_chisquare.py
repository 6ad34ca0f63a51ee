"""Sampling through DFlash's trees and every training-free block refiner (issue 27, item 3): many
independent two-token generations with the production rng, their empirical law against the exact
autoregressive law by a chi-square test (as tests/test_verify_chisquare.py).

The toy block: position k's logits are a toy drafter's at the context extended by the block's
argmax so far, computed once per round (so, as in DFlash, they do not depend on what is drawn).
Bound: each passes when the p-value exceeds 1e-4 (fixed seeds: deterministic). The negative
control, the block's argmax chain verified by rejection sampling as if it had been drawn from q,
must fall below the bound with the same number of runs."""

from collections import Counter

import pytest
import torch
from enumerate_law import ToyModel, autoregressive_law, generate, one_thread
from test_verify_chisquare import chi_square_p_value

from outrider.drafters.block import Block, greedy_chain, sampled_chain
from outrider.drafters.refiners import make_refiner
from outrider.drafters.refiners.lilicorr import Correlator, LiLiCorr
from outrider.sampling import SamplingParams
from outrider.spec.random import PositionalRandom
from outrider.spec.types import DraftTree, VerifyResult
from outrider.spec.verify_chain import verify_chain
from outrider.spec.verify_tree import verify_tree_walk

PROMPT, LENGTH, RUNS, BOUND = [0, 1], 2, 1000, 1e-4
TARGET, DRAFTER = ToyModel(3, seed=1), ToyModel(3, seed=2)
PARAMS = SamplingParams(temperature=1.0)
K = 3


def toy_block(committed: list[int]) -> Block:
    context, rows = list(committed), []
    for _ in range(K):
        row = DRAFTER.logits(context).float()
        rows.append(row)
        context.append(int(row.argmax()))
    return Block(committed[-1], len(committed) - 1, torch.stack(rows), torch.zeros(K + 1, 4), vocab=3)


def refined(refiner, nodes=5):
    """A proposer that tells the refiner the previous round's result, as the drafter does."""
    last = {}

    def propose(committed, rng):
        block = toy_block(committed)
        prev = last.get("tree")
        if prev is not None and len(committed) > last["n"]:
            new = committed[last["n"]:]
            accepted, at = [], 0
            for token in new[:-1]:
                at = next(i for i in range(1, prev.size) if int(prev.parents[i]) == at and int(prev.tokens[i]) == token)
                accepted.append(at)
            block.previous, block.previous_tree = VerifyResult(accepted, list(new)), prev
        tree = refiner.refine(block, greedy_chain(block, K), K, nodes, False)
        last.update(tree=tree, n=len(committed))
        return tree

    return propose


def sampled(committed, rng):
    return sampled_chain(toy_block(committed), 2, PARAMS, rng.drafting())


def argmax_as_if_drawn(committed, rng):
    block = toy_block(committed)
    chain = greedy_chain(block, 2)
    q = torch.stack([torch.softmax(block.logits[k].double(), -1).float() for k in range(2)])
    return DraftTree(chain.tokens, chain.parents, torch.cat((q, torch.zeros(1, 3))))


def p_value(propose, verify, seed=1234):
    with one_thread():
        counts = Counter(generate(PROMPT, LENGTH, PositionalRandom(seed + r), TARGET, propose, verify, PARAMS)
                         for r in range(RUNS))
    law = autoregressive_law(PROMPT, LENGTH, TARGET, PARAMS)
    return chi_square_p_value(counts, law, RUNS)


CORRELATOR = Correlator(torch.tensor([0 * 3 + 2, 1 * 3 + 1, 2 * 3 + 0]), torch.tensor([2.0, -1.0, 1.5]), 3)
CASES = {
    "sampled_chain": lambda: (sampled, verify_chain),
    "ddtree": lambda: (refined(make_refiner("ddtree")), verify_tree_walk),
    "cure": lambda: (refined(make_refiner("cure:0")), verify_tree_walk),
    "retrace": lambda: (refined(make_refiner("retrace")), verify_tree_walk),
    "lilicorr": lambda: (refined(LiLiCorr(CORRELATOR)), verify_tree_walk),
}


@pytest.mark.parametrize("case", CASES)
def test_empirical_law_matches_the_target(case):
    propose, verify = CASES[case]()
    assert p_value(propose, verify) > BOUND


def test_negative_control_has_power():
    assert p_value(argmax_as_if_drawn, verify_chain) < BOUND
