"""Sampling with speculation on a gated-delta hybrid follows the target's own law: the chi-square
test of tests/test_spec_sampling_exact.py (the exact law of the first three tokens over an 8-token
vocabulary, enumerated with the runtime's forward) on a tiny Qwen3.5 target, through a chain
(rejection sampling) and through trees (the tree walk; sibling drafts without replacement), so
that rows held by TreeWY's verify, the fold of the accepted path and the rejected branches' rows
all lie on the sampled path. A broken verifier on the same runs is seen to fail."""

from __future__ import annotations

import pytest
from test_spec_sampling_exact import (BOUND, PROMPT, VOCAB, accept_all, chi_square_p_value, exact_law, run_many,
                                      single_thread, speculator)  # noqa: F401  (single_thread: the fixture)
from tiny import make_tiny

from outrider.drafters.model import ModelDrafter
from outrider.sampling import SamplingParams
from outrider.spec.shapes import parse_shape
from outrider.spec.verifiers import VERIFIERS
from outrider.weights.loader import load_decoder


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """Two gated-delta layers, then attention: the hybrid's two kinds of state, and more than one
    delta layer's state to keep apart (each delta layer's per-slot loop is most of the time: a third
    one, as before, cost about 18% more CPU a case and runs the same code)."""
    types = ["linear_attention", "linear_attention", "full_attention"]
    folder = make_tiny("qwen3_5", tmp_path_factory.mktemp("hybrid8") / "q", vocab=VOCAB, layers=3, layer_types=types)
    return load_decoder(folder, "cpu")


def early_exit(target, shape: str):
    return speculator(ModelDrafter(target, parse_shape(shape), num_layers=1, name="early-exit:1"), shape, 2)


CASES = {  # name: (tree shape, sampling, the verifier it must get, runs)
    "chain": ("chain", SamplingParams(temperature=0.8, top_k=6), "rejection_chain", 500),
    "static_tree": ("static:2,2", SamplingParams(temperature=1.0, top_p=0.9), "tree_walk", 400),
    "sampled_tree": ("sampled:2,2", SamplingParams(temperature=1.0, top_k=6), "multidraft_without_replacement", 400),
}


@pytest.mark.parametrize("case", CASES)
def test_first_tokens_follow_the_hybrids_law(hybrid, case):
    shape, params, verifier, runs = CASES[case]
    spec = early_exit(hybrid, shape)
    assert spec.verifier_for(params) is VERIFIERS[verifier].verify
    counts, accepted = run_many(hybrid, spec, params, runs)
    assert accepted >= runs // 10, "too few drafts accepted: the speculative paths are not exercised"
    assert chi_square_p_value(counts, exact_law(hybrid, params), runs) > BOUND


def test_a_broken_verifier_fails_on_the_hybrid(hybrid):
    """Negative control: every draft accepted without the min(1, p/q) test."""
    _, params, _, runs = CASES["chain"]
    spec = early_exit(hybrid, "chain")
    spec.verifier_for = lambda params: accept_all
    counts, _ = run_many(hybrid, spec, params, runs)
    assert chi_square_p_value(counts, exact_law(hybrid, params), runs) < BOUND
