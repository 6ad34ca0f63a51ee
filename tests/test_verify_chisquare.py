"""The sampling paths with the production rng (PositionalRandom): many independent generations of two tokens,
their empirical law against the exact autoregressive law, by a chi-square test.

Bound: each test passes when the p-value exceeds 1e-4 (a correct verifier would fail with
probability 1e-4 over seeds). The seeds are fixed, so the tests are deterministic, not flaky.
The negative control, a verifier in the wrong sibling mode, must give a p-value below 1e-4
with the same number of runs, so the test can be seen to have the power to bite.
"""

from collections import Counter

import pytest
import torch
from enumerate_law import ToyModel, autoregressive_law, generate, one_thread, sampled_tree

from outrider.sampling import SamplingParams
from outrider.spec.random import PositionalRandom
from outrider.spec.verify_chain import verify_chain
from outrider.spec.verify_multidraft import MultiDraftVerifier
from outrider.spec.verify_tree import verify_tree_walk

PROMPT = [0, 1]
LENGTH = 2
RUNS = 1000
BOUND = 1e-4
TARGET = ToyModel(3, seed=1)
DRAFTER = ToyModel(3, seed=2)


def chi_square_p_value(counts: Counter, law: dict, runs: int) -> float:
    """P(chi2 with len(law) - 1 degrees of freedom >= the statistic); 0 if a count falls outside the law."""
    if any(key not in law for key in counts):
        return 0.0
    stat = sum((counts[key] - runs * p) ** 2 / (runs * p) for key, p in law.items())
    dof = len(law) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def p_value(propose, verify, params, seed):
    with one_thread():  # run r draws from its own seed; within a run, by position (spec/random.py)
        counts = Counter(generate(PROMPT, LENGTH, PositionalRandom(seed + r), TARGET, propose, verify, params)
                         for r in range(RUNS))
    law = autoregressive_law(PROMPT, LENGTH, TARGET, params)
    assert min(law.values()) * RUNS >= 10  # expected counts large enough for the chi-square approximation
    return chi_square_p_value(counts, law, RUNS)


CASES = {
    "chain_k2": (sampled_tree(DRAFTER, [1, 1], False), verify_chain, SamplingParams(temperature=0.8, top_p=0.9)),
    "multidraft_without_replacement": (sampled_tree(DRAFTER, [2, 1], True), MultiDraftVerifier(True), SamplingParams(temperature=1.2)),
    "tree_walk": (sampled_tree(DRAFTER, [2], False, probs=False), verify_tree_walk, SamplingParams(temperature=1.0, top_k=2)),
}


@pytest.mark.parametrize("case", CASES)
def test_empirical_law_matches_exact_law(case):
    propose, verify, params = CASES[case]
    assert p_value(propose, verify, params, seed=1234) > BOUND


def test_negative_control_has_power():
    propose = sampled_tree(DRAFTER, [3], True)  # drawn without replacement, verified as if with
    assert p_value(propose, MultiDraftVerifier(False), SamplingParams(temperature=1.2), seed=1234) < BOUND
