"""Coupled drafting under the walk, enumerated exactly with shared uniforms (issue 38).

A seeded request is verified by the walk, which commits at each position t the token plain
sampling draws there, `categorical(p_t, u_t)` with u_t the uniform of (seed, t, TOKEN); a drafter
that samples its chain draws its draft at t with that same u_t from its own q (coupled drafting,
drafters/capabilities.py `couples`). `EnumeratingUniforms` (enumerate_law.py) keys every draw as
PositionalRandom does, so draws that share a uniform are enumerated as one: the laws below are
exact for the real sharing, across rounds too (a later round reuses the uniforms of positions an
earlier one drafted but did not commit).

Proven here, to 1e-9 on a 3-token toy world:
- the walk with coupled drafts gives exactly p's law (chain and tree walks, reference and
  vectorized), and commits exactly the autoregressive sample: the pair (speculative output,
  plain output with the same uniforms) never differs;
- sampled siblings drawn from their own streams stay exact under the walk;
- the enumerator is no source of false alarms: uncoupled rejection sampling is exact under it.
Negative controls, which must fail: rejection sampling fed coupled drafts (its recovered token
reuses the draft's uniform: why unseeded requests, so verified, never couple); a walk drawing on
another stream (exact in law, but not the autoregressive sample).
"""

from functools import lru_cache

import pytest
import torch
from enumerate_law import (
    EnumeratingUniforms,
    ToyModel,
    autoregressive_law,
    enumerate_law,
    generate,
    max_law_difference,
    sampled_tree,
)

from outrider.sampling import SamplingParams
from outrider.spec.random import PositionalRandom
from outrider.spec.types import DraftTree
from outrider.spec.verify_chain import target_probs, verify_chain
from outrider.spec.verify_greedy import follow_chain
from outrider.spec.verify_tree import verify_chain_walk, verify_tree_walk, verify_tree_walk_reference

PROMPT = [0, 1]
LENGTH = 3
TARGET = ToyModel(3, seed=1)
DRAFTER = ToyModel(3, seed=2)
PARAMS = {
    "t1": SamplingParams(temperature=1.0),
    "t0.7_topk2": SamplingParams(temperature=0.7, top_k=2),
    "t1.5_topp0.8": SamplingParams(temperature=1.5, top_p=0.8),
}
WALKS = {"chain_walk": verify_chain_walk, "tree_walk": verify_tree_walk,
         "tree_walk_reference": verify_tree_walk_reference}


@lru_cache(maxsize=None)
def warped(model: ToyModel, last_two: tuple[int, int], params: SamplingParams) -> torch.Tensor:
    """target_probs of a toy model's logits after a context ending in `last_two` (all its logits
    depend on), computed once: an enumeration runs the whole generation once per branch, so the
    same few contexts come back thousands of times. The verifiers still warp their own logits."""
    return target_probs(model.logits(list(last_two)), params)  # [vocab]


def coupled_chain(drafter: ToyModel, depth: int, params: SamplingParams):
    """A sampled chain `depth` deep whose draft at offset d is drawn from q (the drafter's warped
    distribution) with the verifier's own TOKEN uniform at that position, as a coupled model
    drafter draws it (drafters/model_growers.py `_chain` with `start(coupled=True)`); q kept."""

    def propose(committed: list[int], rng) -> DraftTree:
        context, drafts, qs = list(committed), [], []
        for d in range(depth):
            q = warped(drafter, tuple(context[-2:]), params)  # [vocab]
            x = rng.categorical(q, offset=d)  # the walk's draw at this position: the same uniform
            drafts.append(x)
            qs.append(q)
            context.append(x)
        probs = torch.cat([torch.stack(qs), torch.zeros(1, drafter.vocab, dtype=torch.float64)])  # [depth + 1, vocab]
        return DraftTree.chain(committed[-1], drafts, probs)

    return propose


def plain(prompt: list[int], length: int, rng, params: SamplingParams) -> tuple[int, ...]:
    """Plain sampling with the same rng: position t's token is categorical(p_t, u_t), u_t of (t, TOKEN, 0)."""
    committed = list(prompt)
    while len(committed) < len(prompt) + length:
        committed.append(rng.at(len(committed)).categorical(warped(TARGET, tuple(committed[-2:]), params)))
    return tuple(committed[len(prompt):])


def paired_law(propose, verify, params: SamplingParams) -> dict:
    """The law of (speculative output, plain output) with one set of shared uniforms."""
    return enumerate_law(lambda rng: (generate(PROMPT, LENGTH, rng, TARGET, propose, verify, params),
                                      plain(PROMPT, LENGTH, rng, params)), make=EnumeratingUniforms)


def speculative_law(paired: dict) -> dict:
    """The first output's law, from the pair's."""
    law = {}
    for (fast, _), w in paired.items():
        law[fast] = law.get(fast, 0.0) + w
    return law


def apart(paired: dict) -> float:
    """The probability that the speculative output is not the plain one."""
    return sum(w for (fast, slow), w in paired.items() if fast != slow)


CASES = [("chain_walk", "t1", 2), ("chain_walk", "t0.7_topk2", 3), ("chain_walk", "t1.5_topp0.8", 2),
         ("tree_walk", "t0.7_topk2", 2), ("tree_walk_reference", "t1.5_topp0.8", 2)]


@pytest.mark.parametrize("walk, params, depth", CASES, ids=[f"{w}-{p}-{d}" for w, p, d in CASES])
def test_the_walk_with_coupled_drafts_is_exact_and_the_plain_sample(walk, params, depth):
    """Over every branch of every shared uniform: the speculative tokens are the plain ones, so
    their law is p's (the drafts' uniforms reused by later rounds included)."""
    paired = paired_law(coupled_chain(DRAFTER, depth, PARAMS[params]), WALKS[walk], PARAMS[params])
    assert apart(paired) == 0.0
    expected = autoregressive_law(PROMPT, LENGTH, TARGET, PARAMS[params])
    assert max_law_difference(speculative_law(paired), expected) < 1e-9


def test_coupling_accepts_more_than_independent_drafts():
    """The point of coupling: the first draft is accepted with probability sum_i |bucket_p(i) and
    bucket_q(i)| (the overlap of the two inverse-CDF buckets) instead of sum_i p(i) q(i)."""
    params = PARAMS["t1"]
    p = target_probs(TARGET.logits(PROMPT), params)  # [vocab]
    q = target_probs(DRAFTER.logits(PROMPT), params)

    def first_accepted(propose):
        def fn(rng):
            tree = propose(PROMPT, rng.at(len(PROMPT)))
            logits = torch.stack([TARGET.logits(PROMPT), TARGET.logits(PROMPT + [int(tree.tokens[1])])])
            return verify_chain_walk(tree, logits, params, rng.at(len(PROMPT))).num_accepted
        return enumerate_law(fn, make=EnumeratingUniforms)[1]

    cp, cq = [0.0, *p.cumsum(0).tolist()], [0.0, *q.cumsum(0).tolist()]
    overlap = sum(max(0.0, min(cp[i + 1], cq[i + 1]) - max(cp[i], cq[i])) for i in range(3))
    assert first_accepted(coupled_chain(DRAFTER, 1, params)) == pytest.approx(overlap, abs=1e-12)
    independent = first_accepted(sampled_tree(DRAFTER, [1], False))  # raw q from the drafting streams
    assert independent == pytest.approx(float((p * DRAFTER.probs(PROMPT)).sum()), abs=1e-12)
    assert overlap > independent


def test_sampled_siblings_on_their_own_streams_stay_exact():
    params = PARAMS["t0.7_topk2"]
    paired = paired_law(sampled_tree(DRAFTER, [2], True), verify_tree_walk, params)
    assert apart(paired) == 0.0
    assert max_law_difference(speculative_law(paired), autoregressive_law(PROMPT, LENGTH, TARGET, params)) < 1e-9


def rejection_law(propose) -> dict:
    params = PARAMS["t1"]
    return enumerate_law(lambda rng: generate(PROMPT, LENGTH, rng, TARGET, propose, verify_chain, params),
                         make=EnumeratingUniforms)


def test_the_enumerator_finds_uncoupled_rejection_sampling_exact():
    """Drafts from the drafter's own streams: rejection sampling is exact, and the shared-uniform
    enumeration says so (no false alarm where nothing is shared)."""
    law = rejection_law(sampled_tree(DRAFTER, [1, 1], False))
    assert max_law_difference(law, autoregressive_law(PROMPT, LENGTH, TARGET, PARAMS["t1"])) < 1e-9


def test_negative_control_rejection_sampling_with_coupled_drafts():
    """Rejection sampling needs drafts independent of its own draws; coupled drafts share the
    uniform its recovered token is drawn with, and its law leaves p."""
    law = rejection_law(coupled_chain(DRAFTER, 2, PARAMS["t1"]))
    assert max_law_difference(law, autoregressive_law(PROMPT, LENGTH, TARGET, PARAMS["t1"])) > 1e-3


def walk_on_another_stream(tree, target_logits, params, rng):
    """Wrong on purpose: the chain walk with its draws on the drafting streams (exact in law,
    since the walk is exact for any drafts, but not the token plain sampling draws)."""
    p = target_probs(target_logits, params)  # [n, vocab]
    return follow_chain(tree, rng.drafting().categorical_rows(p, torch.arange(tree.size)))


def test_negative_control_a_walk_on_another_stream_is_not_the_plain_sample():
    params = PARAMS["t0.7_topk2"]
    paired = paired_law(coupled_chain(DRAFTER, 1, params), walk_on_another_stream, params)
    assert max_law_difference(speculative_law(paired), autoregressive_law(PROMPT, LENGTH, TARGET, params)) < 1e-9
    assert apart(paired) > 0.1


def test_the_enumerator_keys_as_positional_random_does():
    """Same (position, stream, index), same uniform: a PositionalRandom draw falls in the bucket the
    enumerator's branch says for it, for the verifier's views and the drafter's."""
    probs = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    law = enumerate_law(lambda rng: (rng.at(5).categorical(probs, offset=2), rng.at(7).categorical(probs * 2),
                                     rng.at(7).drafting().categorical(probs)), make=EnumeratingUniforms)
    assert len(law) == 9 and all(a == b for a, b, _ in law)  # (5, 2) and (7, 0) are one key; drafting is another
    seeded = PositionalRandom(3)
    assert seeded.at(5).categorical(probs, offset=2) == seeded.at(7).categorical(probs * 2)
