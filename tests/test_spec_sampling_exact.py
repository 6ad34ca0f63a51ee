"""Sampling with speculation follows the target's own law, end to end through `generate_ids`.

A tiny random target with a vocabulary of 8 tokens makes the exact law of the first three
generated tokens computable: P(a, b, c) = p(a | prompt) p(b | prompt a) p(c | prompt a b), one
batched target forward per level of prefixes with our runtime, warped (temperature, top-k,
top-p) in float64. Each case runs `generate_ids` on many requests at once, each unseeded (a
request without a seed gets the verifier of most acceptance; a seeded one the walk, whose law
tests/test_verify_coupled.py enumerates), under one `torch.manual_seed`, with one drafter and tree
shape, so that one exact verifier does the work:

    early-exit chain, sampled drafts with q      -> rejection_chain
    ngram chain (drafts without q)               -> chain_walk
    static tree of top-k children (early exit)   -> tree_walk
    independent draft model, sampled chain       -> rejection_chain
    EAGLE-3 head (random), sampled chain with q  -> rejection_chain
    EAGLE-3 head, dynamic tree (best-first)      -> tree_walk
    early exit / EAGLE-3, sampled:2,2 siblings   -> multidraft_without_replacement

Drafts are 2 deep and 3 tokens are compared, so the law covers tokens committed by the first
round and by the next one, after the accepted path was compacted in the target's cache.

Bound: a case passes when the chi-square p-value exceeds 1e-4 (a correct engine fails with
probability 1e-4 over seeds). The seeds are fixed, so the tests are deterministic, not flaky.
Cells expected fewer than 5 times are pooled into their prefix's bin ((a, b, c) -> (a, b, *),
then (a, *, *)), so every bin expects at least 5; an outcome outside the law's support (cut by
top-k or top-p) gives p-value 0. The negative controls plug broken verifiers into every
Sequence (no min(1, p/q) test; or the recovered token drawn from p instead of the residual)
and must give a p-value below 1e-4 with the same sampling and runs, so the test is seen to bite.
"""

import atexit
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import pytest
import torch
from eagle3_tiny import write_eagle3
from enumerate_law import one_thread
from tiny import make_tiny

from outrider.control.controllers import FixedController
from outrider.drafters.eagle3 import Eagle3Drafter
from outrider.drafters.model import ModelDrafter
from outrider.heads.eagle3.format import load_eagle3
from outrider.drafters.ngram import NgramDrafter
from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.models.batch import pack
from outrider.weights.loader import load_decoder
from outrider.sampling import SamplingParams, warp_probs
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.spec.shapes import parse_shape
from outrider.spec.types import VerifyResult
from outrider.spec.verifiers import VERIFIERS
from outrider.spec.verify_chain import accept_probability, draft_distribution, target_probs

VOCAB = 8
PROMPT = [3, 4, 5, 3, 4, 5, 3]  # repeats, so the ngram drafter finds matches
LENGTH = 3  # output tokens whose joint law is compared
BOUND = 1e-4
LEAST = 5.0  # smallest expected count of a chi-square cell
SEED = 7000  # torch.manual_seed before the unseeded requests draw theirs (libraspec's test: request i's seed)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Target and an independent one-layer draft model, both Llama with the 8-token vocabulary,
    and the draft model again with a reduced head (tokens 0, 2, 3, 5, 6: it never proposes 1, 4
    or 7, which the target does produce)."""
    root = tmp_path_factory.mktemp("vocab8")
    target = load_decoder(make_tiny("llama", root / "target", vocab=VOCAB, seed=0), "cpu")
    folder = make_tiny("llama", root / "draft", vocab=VOCAB, seed=3, layers=1)
    draft = load_decoder(folder, "cpu")
    reduced = load_decoder(folder, "cpu", head_ids=torch.tensor([0, 2, 3, 5, 6]))
    return target, draft, reduced


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """Thousands of forwards on tiny tensors: intra-op threads only cost time here."""
    with one_thread():
        yield


def speculator(drafter, shape: str, depth: int) -> Speculator:
    options = SpecOptions(drafter.name, shape, f"fixed:{depth}")
    return Speculator(options, drafter, FixedController(depth), parse_shape(shape))


_HEAD_DIRS: dict[int, Path] = {}


def eagle3_speculator(target, shape: str, depth: int) -> Speculator:
    """A tiny random EAGLE-3 head (draft vocabulary 6 of 8: two target tokens it can never
    propose) drafting for `target`; its folder is written once per process."""
    if id(target) not in _HEAD_DIRS:
        folder = Path(tempfile.mkdtemp(prefix="outrider-e3law-"))
        atexit.register(shutil.rmtree, folder, True)
        c = target.config
        config = {"hidden_size": c.hidden_size, "vocab_size": c.vocab_size, "num_attention_heads": c.num_heads,
                  "num_key_value_heads": c.num_kv_heads, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta}
        _HEAD_DIRS[id(target)] = write_eagle3(folder / "head", config, draft_vocab=6, seed=2, layer_ids=(0, 1, 1))
    head = load_eagle3(_HEAD_DIRS[id(target)], target)
    drafter = Eagle3Drafter(head, parse_shape(shape), head.config.taps(target.config.num_layers), name="eagle3:tiny")
    return speculator(drafter, shape, depth)


# -- the exact law ------------------------------------------------------------------------------
def next_logits(target, contexts: list[list[int]]) -> torch.Tensor:
    """The target's logits after each context, one slot each: -> [len(contexts), vocab]."""
    cache = target.new_cache(len(contexts), max(map(len, contexts)) + 1)
    batch = pack(list(range(len(contexts))), [0] * len(contexts), [torch.tensor(c) for c in contexts],
                 logits="last", scratch_row=cache.scratch_row, device=target.device)
    return target.forward(batch, cache).logits[:, -1]


def exact_law(target, params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(first LENGTH output tokens = s) under plain sampling from the target, one level of
    prefixes per batched forward; only the s with positive probability."""
    law = {(): 1.0}
    for _ in range(LENGTH):
        prefixes = list(law)
        probs = warp_probs(next_logits(target, [PROMPT + list(s) for s in prefixes]).double(), params)  # [n, vocab]
        law = {s + (t,): law[s] * float(probs[i, t])
               for i, s in enumerate(prefixes) for t in range(VOCAB) if probs[i, t] > 0}
    return law


def pooled(law: dict, counts: Counter, runs: int) -> list[tuple[float, int]]:
    """Bins of (probability, count) that partition the outcomes, each expected >= LEAST times.

    A cell expected fewer times joins the bin of its prefix one token shorter, with its small
    siblings ((a, b, c) -> (a, b, *)); a prefix bin still too small joins its own prefix, and so
    on up to the empty prefix, which, if still too small, joins the smallest bin."""
    bins = {key: (p, counts[key]) for key, p in law.items()}
    for length in range(LENGTH, 0, -1):
        for key in [k for k in bins if len(k) == length and bins[k][0] * runs < LEAST]:
            p, n = bins.pop(key)
            q, m = bins.get(key[:-1], (0.0, 0))
            bins[key[:-1]] = (q + p, m + n)
    rest = bins.pop((), None)
    if rest is not None and rest[0] * runs < LEAST:
        smallest = min(bins, key=lambda k: bins[k][0])
        bins[smallest] = (bins[smallest][0] + rest[0], bins[smallest][1] + rest[1])
    elif rest is not None:
        bins[()] = rest
    return list(bins.values())


def chi_square_p_value(counts: Counter, law: dict, runs: int) -> float:
    """P(chi2 >= the statistic) over the pooled bins; 0 when a count falls outside the support."""
    if any(key not in law for key in counts):
        return 0.0
    bins = pooled(law, counts, runs)
    assert len(bins) >= 2 and all(p * runs >= LEAST for p, _ in bins)
    assert sum(n for _, n in bins) == runs
    stat = sum((n - runs * p) ** 2 / (runs * p) for p, n in bins)
    dof = torch.tensor((len(bins) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, torch.tensor(stat / 2, dtype=torch.float64)))


def run_many(target, spec: Speculator, params: SamplingParams, runs: int) -> tuple[Counter, int]:
    """`runs` unseeded requests (their seeds drawn after torch.manual_seed(SEED)) in one
    generate_ids call -> (counts of the first LENGTH output tokens, drafts accepted in all)."""
    requests = [Request(list(PROMPT), LENGTH, SamplingParams(params.temperature, params.top_k, params.top_p))
                for _ in range(runs)]
    torch.manual_seed(SEED)
    outs = generate_ids(target, requests, set(), speculation=spec)
    counts = Counter(tuple(f.token_ids[:LENGTH]) for f in outs)
    return counts, sum(sum(f.round_stats.accepted_by_position) for f in outs)


# -- the cases ----------------------------------------------------------------------------------
# name: (make the speculator from (target, draft, reduced draft), sampling, the verifier it must get, runs)
CASES = {
    "early_exit_chain": (
        lambda t, d, r: speculator(ModelDrafter(t, parse_shape("chain"), num_layers=1, name="early-exit:1"), "chain", 2),
        SamplingParams(temperature=0.8, top_k=6), "rejection_chain", 600),
    "ngram_chain": (
        lambda t, d, r: speculator(NgramDrafter(), "chain", 3),
        SamplingParams(temperature=0.8), "chain_walk", 1000),
    "static_tree": (
        lambda t, d, r: speculator(ModelDrafter(t, parse_shape("static:2,2"), num_layers=1, name="early-exit:1"),
                                "static:2,2", 2),
        SamplingParams(temperature=1.0, top_p=0.9), "tree_walk", 400),
    "draft_model_chain": (
        lambda t, d, r: speculator(ModelDrafter(d, parse_shape("chain"), name="draft-model:tiny"), "chain", 2),
        SamplingParams(temperature=0.8, top_k=5, top_p=0.95), "rejection_chain", 500),
    "draft_model_reduced_vocab": (
        lambda t, d, r: speculator(ModelDrafter(r, parse_shape("chain"), name="draft-model:tiny,vocab=5"), "chain", 2),
        SamplingParams(temperature=0.8, top_k=6), "rejection_chain", 500),
    "eagle3_chain": (
        lambda t, d, r: eagle3_speculator(t, "chain", 2),
        SamplingParams(temperature=0.9, top_k=6), "rejection_chain", 500),
    "eagle3_dynamic_tree": (
        lambda t, d, r: eagle3_speculator(t, "dynamic:2,4", 2),
        SamplingParams(temperature=1.0, top_p=0.95), "tree_walk", 400),
    "early_exit_sampled_tree": (
        lambda t, d, r: speculator(ModelDrafter(t, parse_shape("sampled:2,2"), num_layers=1, name="early-exit:1"),
                                   "sampled:2,2", 2),
        SamplingParams(temperature=1.0, top_k=6), "multidraft_without_replacement", 400),
    "eagle3_sampled_tree": (
        lambda t, d, r: eagle3_speculator(t, "sampled:3,1", 2),
        SamplingParams(temperature=0.8, top_p=0.95), "multidraft_without_replacement", 400),
}


@pytest.mark.parametrize("case", CASES)
def test_first_tokens_follow_the_target_law(models, case):
    make, params, verifier, runs = CASES[case]
    spec = make(*models)
    assert spec.verifier_for(params) is VERIFIERS[verifier].verify
    counts, accepted = run_many(models[0], spec, params, runs)
    assert accepted >= runs // 10, "too few drafts accepted: the speculative paths are not exercised"
    assert chi_square_p_value(counts, exact_law(models[0], params), runs) > BOUND


def accept_all(tree, target_logits, params, rng) -> VerifyResult:
    """Broken on purpose: every draft is accepted without the min(1, p/q) test; bonus from p."""
    k = tree.size - 1
    bonus = rng.categorical(target_probs(target_logits[k], params), offset=k)
    return VerifyResult(list(range(1, k + 1)), tree.tokens[1:].tolist() + [bonus])


def recover_from_p(tree, target_logits, params, rng) -> VerifyResult:
    """Broken on purpose, subtly: the min(1, p/q) test, but after a rejection the token is drawn
    from p instead of the residual norm(max(p - q, 0)). Never leaves p's support."""
    k = tree.size - 1
    p = target_probs(target_logits, params)  # [n, vocab]
    q = draft_distribution(tree.draft_probs[:k])  # [k, vocab]
    drafts = tree.tokens[1:].tolist()
    for i, x in enumerate(drafts):
        if not rng.uniform_below(accept_probability(p[i], q[i], x), offset=i):
            return VerifyResult(list(range(1, i + 1)), drafts[:i] + [rng.categorical(p[i], offset=i)])
    return VerifyResult(list(range(1, k + 1)), drafts + [rng.categorical(p[k], offset=k)])


@pytest.mark.parametrize("broken", [accept_all, recover_from_p])
def test_negative_control_has_power(models, broken):
    """The early-exit case, same sampling and runs, with a broken verifier in every Sequence
    (a monkeypatched `verifier_for`): the p-value falls below the bound. accept_all also commits
    drafts outside p's top-k; recover_from_p does not, so the chi-square statistic alone rejects it."""
    make, params, _, runs = CASES["early_exit_chain"]
    spec = make(*models)
    spec.verifier_for = lambda params: broken
    counts, _ = run_many(models[0], spec, params, runs)
    law = exact_law(models[0], params)
    if broken is recover_from_p:
        assert all(key in law for key in counts)
    assert chi_square_p_value(counts, law, runs) < BOUND


# -- determinism and sanity ---------------------------------------------------------------------
def outputs(target, spec, params: SamplingParams, seeds, n: int = 10) -> list[list[int]]:
    requests = [Request(list(PROMPT), n, SamplingParams(params.temperature, params.top_k, params.top_p, s))
                for s in seeds]
    return [f.token_ids for f in generate_ids(target, requests, set(), speculation=spec)]


@pytest.mark.parametrize("case", CASES)
def test_same_seed_same_tokens(models, case):
    make, params, _, _ = CASES[case]
    seeds = [11, 12, 13, 11]
    first = outputs(models[0], make(*models), params, seeds)
    assert outputs(models[0], make(*models), params, seeds) == first  # a fresh speculator, same seeds
    assert first[0] == first[3]  # the same seed twice in one batch
    assert len({tuple(o) for o in first}) > 1  # other seeds, other tokens


def test_sampling_differs_from_greedy(models):
    target = models[0]
    make, params, _, _ = CASES["early_exit_chain"]
    greedy = outputs(target, make(*models), SamplingParams(), [None], n=12)[0]
    assert outputs(target, None, SamplingParams(), [None], n=12)[0] == greedy  # speculation keeps greedy
    for sampled in outputs(target, make(*models), params, [21, 22, 23], n=12):
        assert sampled != greedy


def test_warp_probs_keeps_float64():
    """float64 logits give float64 probabilities (the exact law above relies on it); others float32."""
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    for params in (SamplingParams(), SamplingParams(temperature=0.7, top_k=4, top_p=0.9)):
        assert warp_probs(logits.double(), params).dtype == torch.float64
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            assert warp_probs(logits.to(dtype), params).dtype == torch.float32
        torch.testing.assert_close(warp_probs(logits.double(), params).float(), warp_probs(logits, params))
