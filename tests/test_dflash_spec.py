"""DFlash drafting end to end (issue 27, items 1 and 5) on a tiny random target with a tiny random
head sharing its embedding and output head: the fast block forward equals the plain reference;
greedy speculative output equals autoregressive output for the argmax chain, DDTree and every
block refiner; a sampled chain is rejection sampling (reproducible per seed, the tree walk for
trees equals plain sampling); DDTree keeps the N best prefixes."""

import itertools
import math

import pytest
import torch
from dflash_fixtures import random_head
from enumerate_law import one_thread

from outrider.control.controllers import FixedController
from outrider.drafters.block import Block, ddtree, greedy_chain
from outrider.drafters.dflash import DFlashDrafter
from outrider.drafters.refiners import make_refiner, parse_refiners, with_refiners
from outrider.engine.generate import generate_ids
from outrider.engine.loop import EngineLoop
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.errors import ConfigError
from outrider.heads.dflash.reference import reference_block
from outrider.sampling import SamplingParams
from outrider.spec.shapes import parse_shape
from outrider.spec.verifiers import VERIFIERS
from outrider.weights.loader import load_decoder

PROMPTS = [[3, 4, 5, 3, 4, 5, 3], [6, 7, 3, 6, 7, 3, 6], [5], [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4]]
REFINED = ["ddtree", "retrace", "cure", "ddtree+retrace", "dartree", "lilicorr", "cure+lilicorr+dartree"]


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from tiny import make_tiny

    folder = make_tiny("llama", tmp_path_factory.mktemp("dfspec") / "t", vocab=8, layers=4)
    return load_decoder(folder, "cpu")


def head_for(target, seed=3, block=5, draft_vocab=None):
    return random_head(hidden=64, vocab=8, layers=2, heads=4, kv_heads=2, block=block, taps=3, seed=seed,
                       embed=target.embed, lm_head=target.lm_head, draft_vocab=draft_vocab, mask_token_id=0)


@pytest.fixture(scope="module")
def learned(tmp_path_factory):
    """Random weights for the trained refiners: a DARTree correction head and a LiLiCorr correlator."""
    from outrider.drafters.refiners.dartree import CorrectionHead
    from outrider.drafters.refiners.lilicorr import Correlator

    root = tmp_path_factory.mktemp("refiners")
    g = torch.Generator().manual_seed(7)
    CorrectionHead(torch.randn(16, 128, generator=g) * 0.3, torch.randn(64, 16, generator=g) * 0.3,
                   torch.ones(64), torch.ones(64), None).save(root / "dartree")
    keys = torch.tensor(sorted({a * 8 + b for a, b in torch.randint(0, 8, (20, 2), generator=g).tolist()}))
    Correlator(keys, torch.randn(keys.numel(), generator=g) * 2, 8, 1.0).save(root / "lilicorr")
    return root


def _spec_name(name, learned):
    return f"{name}:{learned / name}" if name in ("dartree", "lilicorr") and learned is not None else name


def speculator(target, tree="chain", refiners=(), depth=3, learned=None, **head):
    h = head_for(target, **head)
    shape = parse_shape(tree)
    drafter = DFlashDrafter(h, shape, h.config.taps(target.config.num_layers),
                            tuple(make_refiner(_spec_name(r, learned), h) for r in refiners))
    return Speculator(SpecOptions("dflash:x", tree, f"fixed:{depth}"), drafter, FixedController(depth), shape)


def run(target, spec, params=SamplingParams(), n=16, **engine):
    requests = [Request(list(p), n, params) for p in PROMPTS]
    if not engine:
        return [f.token_ids for f in generate_ids(target, requests, set(), speculation=spec)]
    return [f.token_ids for f in EngineLoop(target, set(), spec, **engine).run_all(requests)]


def test_the_block_forward_equals_the_reference_for_every_slot_and_context():
    h = random_head(seed=1, draft_vocab=torch.tensor([0, 2, 3, 5, 7, 11, 13, 40, 63]))
    feats = torch.randn(3, 11, 2, 32)
    cache = h.new_cache(4, 16)
    ctx, slots = [11, 4, 0], [3, 0, 1]
    for s, (slot, n) in enumerate(zip(slots, ctx)):
        h.write_context(cache, slot, 0, h.fuse(feats[s, :n]))
    toks = torch.tensor([[5, 1, 1, 1, 1, 1], [7, 1, 1, 1, 1, 1], [9, 1, 1, 1, 1, 1]])
    logits, _ = h.block(cache, slots, ctx, toks)
    for s, n in enumerate(ctx):
        torch.testing.assert_close(logits[s], reference_block(h, feats[s, :n], toks[s]).float(), atol=2e-4, rtol=1e-4)
    # written in two pieces (a round's catch-up after the prompt's) the context is the same
    cache2 = h.new_cache(4, 16)
    h.write_context(cache2, 3, 0, h.fuse(feats[0, :6]))
    h.write_context(cache2, 3, 6, h.fuse(feats[0, 6:11]))
    torch.testing.assert_close(h.block(cache2, [3], [11], toks[:1])[0][0], logits[0])


@pytest.mark.parametrize("tree,refiners", [("chain", ()), ("ddtree:6", ())]
                         + [("ddtree:6", tuple(parse_refiners(r))) for r in REFINED])
def test_greedy_equals_autoregressive_and_drafts_are_accepted(target, learned, tree, refiners):
    spec = speculator(target, tree, refiners, learned=learned)
    want = "greedy_chain" if tree == "chain" else "greedy_tree"
    assert spec.verifier_for(SamplingParams()) is VERIFIERS[want].verify
    fast = run(target, spec)
    assert fast == run(target, None)
    assert run(target, spec, max_running=2, chunk_size=3) == fast  # chunked prefill, requests joining


def test_drafts_are_accepted_sometimes(target):
    spec = speculator(target, "ddtree:8")
    requests = [Request(list(p), 16) for p in PROMPTS]
    done = generate_ids(target, requests, set(), speculation=spec)
    assert sum(f.round_stats.committed for f in done) > sum(f.round_stats.rounds for f in done)


def test_sampled_chain_is_rejection_sampling_reproducible_per_seed(target):
    spec = speculator(target, "chain")
    p1 = SamplingParams(temperature=1.0, seed=1)
    assert spec.verifier_for(p1) is VERIFIERS["rejection_chain"].verify
    a = run(target, spec, p1)
    assert a == run(target, spec, p1) == run(target, spec, p1, max_running=2, chunk_size=3)
    assert a != run(target, spec, SamplingParams(temperature=1.0, seed=2))


@pytest.mark.parametrize("refiners", [(), ("cure", "retrace"), ("dartree", "lilicorr")])
def test_sampled_trees_equal_plain_sampling(target, learned, refiners):
    spec = speculator(target, "ddtree:6", refiners, learned=learned)
    params = SamplingParams(temperature=1.0, seed=5)
    assert spec.verifier_for(params) is VERIFIERS["tree_walk"].verify
    assert run(target, spec, params) == run(target, None, params)


def _block(logits, root=9):
    return Block(root, 0, torch.tensor(logits), torch.zeros(len(logits) + 1, 4), vocab=len(logits[0]))


def test_ddtree_keeps_the_n_best_prefixes_under_the_product_of_marginals():
    torch.manual_seed(0)
    block = _block(torch.randn(3, 4).mul(2).tolist())
    logp = block.logp
    prefixes = [p for d in range(1, 4) for p in itertools.product(range(4), repeat=d)]
    score = {p: sum(float(logp[i, t]) for i, t in enumerate(p)) for p in prefixes}
    for n in (1, 3, 7, 20):
        tree = ddtree(block, 3, n)
        got = set()
        for i in range(1, tree.size):
            path, j = [], i
            while j > 0:
                path.append(int(tree.tokens[j]))
                j = int(tree.parents[j])
            got.add(tuple(reversed(path)))
        best = sorted(score.values(), reverse=True)[:n]
        assert len(got) == n and sorted((score[p] for p in got), reverse=True) == pytest.approx(best)
        assert all(int(p) < i for i, p in enumerate(tree.parents.tolist()) if i)
        assert math.isclose(float(tree.confidence[1]), math.exp(best[0]), rel_tol=1e-5)


def test_greedy_chain_is_the_argmax_and_stops_on_confidence():
    block = _block([[0.0, 3.0, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 0.1]])
    assert greedy_chain(block, 3).tokens.tolist() == [9, 1, 0, 2]
    assert greedy_chain(block, 2).tokens.tolist() == [9, 1, 0]
    assert greedy_chain(block, 3, min_confidence=0.75).tokens.tolist() == [9, 1, 0]  # 0.91 * 0.79 < 0.75: cut after the 2nd


def test_refiners_are_refused_on_a_chain_and_for_other_drafters(target):
    h = head_for(target)
    with pytest.raises(ConfigError, match="ddtree"):
        DFlashDrafter(h, parse_shape("chain"), (1, 2, 3), (make_refiner("cure", h),))
    with pytest.raises(ConfigError, match="unknown refiner 'nope'"):
        parse_refiners("cure,nope")
    with pytest.raises(ConfigError, match="drafts no block"):
        with_refiners("suffix", "cure")
    with pytest.raises(ConfigError, match="--drafter dflash"):
        with_refiners(None, "cure")
    assert with_refiners("dflash:x", "cure,retrace") == "dflash:x,refine=cure+retrace"


def _paths(tree):
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    out, paths = set(), {0: ()}
    for i in range(1, len(tokens)):
        paths[i] = paths[parents[i]] + (tokens[i],)
        out.add(paths[i])
    return out


def test_retrace_offers_the_rejected_suffix_realigned_after_the_correction():
    from outrider.spec.types import DraftTree, VerifyResult

    # last round: chain 9 -> 1 2 3 4; the target took 1, rejected 2 and wrote 7
    previous = DraftTree.chain(9, [1, 2, 3, 4])
    previous = DraftTree(previous.tokens, previous.parents, confidence=torch.tensor([1.0, .9, .8, .7, .6]))
    result = VerifyResult([1], [1, 7])
    block = _block(torch.zeros(4, 10).tolist(), root=7)
    block.previous, block.previous_tree = result, previous
    chain = greedy_chain(block, 4)
    tree = make_refiner("retrace").refine(block, chain, 4, 10, True)
    got = _paths(tree)
    assert (3, 4) in got and (2, 3, 4) in got  # substitution and insertion
    assert (0, 0) in got  # the block's own chain keeps its best nodes
    assert tree.size - 1 <= 10
    # nothing rejected last round (every draft taken): the tree is left alone
    block.previous = VerifyResult([1, 2, 3, 4], [1, 2, 3, 4, 7])
    assert _paths(make_refiner("retrace").refine(block, chain, 4, 8, True)) == _paths(chain)


def test_cure_branches_only_at_uncertain_positions():
    sure, unsure = [8.0, 0.0, 0.0, 0.0], [1.0, 0.9, 0.8, 0.0]
    block = _block([sure, unsure, sure], root=9)  # position 2 is the uncertain one
    chain = greedy_chain(block, 3)
    tree = make_refiner("cure").refine(block, chain, 3, 8, True)
    got = _paths(tree)
    assert (0, 0, 0) in got and (0, 1, 0) in got and (0, 2, 0) in got  # repairs at position 2, chain tail after
    assert not any(p[0] != 0 for p in got)  # no branching at the sure first position
    assert make_refiner("cure:100").refine(block, chain, 3, 8, True) is chain  # nothing uncertain enough


def test_lilicorr_prefers_the_correlated_pair_and_fits_pmi_from_counts():
    from outrider.drafters.refiners.lilicorr import Correlator, LiLiCorr
    from outrider.train.lilicorr import fit

    # position 1: tokens 1 and 2 nearly tied; position 2: 3 and 4 tied; C(2, 4) is large
    block = _block([[0.0, 1.0, 0.9, -5.0, -5.0, -5.0], [0.0, -5.0, -5.0, 1.0, 1.0, -5.0]], root=0)
    c = Correlator(torch.tensor([2 * 6 + 4]), torch.tensor([3.0]), 6, 1.0)
    tree = LiLiCorr(c).refine(block, greedy_chain(block, 2), 2, 2, True)
    assert _paths(tree) == {(2,), (2, 4)}  # a budget of 2: the correlated path, not the marginals' (1, 3)
    seqs = [[1, 2, 1, 2, 3, 1, 2]] * 30
    fitted = fit(seqs, 6, min_count=2, weight=1.0)
    assert float(fitted.pair(torch.tensor([1]), torch.tensor([2]))[0, 0]) > 0  # 1 -> 2 always
    assert float(fitted.pair(torch.tensor([2]), torch.tensor([2]))[0, 0]) == 0  # never seen


def test_dartree_grows_from_corrected_distributions(target, learned):
    from outrider.drafters.refiners.dartree import CorrectionHead, DARTree

    h = head_for(target, block=4)
    H = h.config.hidden_size
    # a correction head whose output pushes hard towards token 5 whatever the parent
    push = h.w.lm_head[5].float() / h.w.lm_head[5].float().norm() * 200
    c = CorrectionHead(torch.zeros(1, 2 * H), torch.zeros(H, 1), torch.ones(H), torch.ones(H), h)
    c.hidden = lambda hh, parents: hh * 0 + push  # noqa: E731
    block = Block(3, 5, torch.randn(3, 8), torch.randn(4, H), vocab=8)
    from outrider.spec.types import DraftTree

    tree = DARTree(c).refine(block, DraftTree.root_only(3), 3, 12, True)
    deep = [t for t, p in zip(tree.tokens.tolist()[1:], tree.parents.tolist()[1:]) if p != 0]
    assert len(deep) == 8 and all(t == 5 for t in deep)  # 4 + 4 + 4: every node below depth 1 is the pushed 5


def test_dartree_training_lowers_the_loss(target):
    from outrider.train.dartree import train

    h = head_for(target, block=4)
    seqs = [[(i * 3 + j) % 8 for j in range(14)] for i in range(4)]
    lines = []
    train(h, target, seqs, steps=60, hidden=16, anchors=4, lr=3e-2, log=lines.append)
    first = float(lines[0].split("loss ")[1].split()[0])
    last = float(lines[-1].split("loss ")[1].split()[0])
    assert last < first


@pytest.mark.parametrize("quantized", [False, True])
def test_a_reduced_readout_keeps_the_same_logits_for_the_tokens_it_keeps(tmp_path, quantized):
    from outrider.drafters.dflash_vocab import reduce_readout
    from outrider.kernels import quant_linear
    from outrider.kernels.blocks import quantize

    lm = torch.randn(64, 32)
    if quantized:
        blocks = quantize(lm, "q8_0")
        lm = quant_linear.QuantLinear(blocks, torch.float32, quant_linear.choose_kernel(blocks))
    h = random_head(seed=2, lm_head=lm)
    (tmp_path / "tokenizer.json").write_text('{"added_tokens": [{"id": 60}]}')
    small = reduce_readout(h, tmp_path, 10)
    ids = small.w.draft_to_target.tolist()
    assert ids == list(range(10)) + [60]
    cache = h.new_cache(1, 8)
    h.write_context(cache, 0, 0, h.fuse(torch.randn(5, 2, 32)))
    toks = torch.tensor([[5, 1, 1, 1, 1, 1]])
    full, _ = h.block(cache, [0], [5], toks)
    cut, _ = small.block(cache, [0], [5], toks)
    torch.testing.assert_close(cut[0], full[0][:, ids], atol=1e-5, rtol=1e-5)
    assert reduce_readout(h, tmp_path, 1000) is h  # nothing to cut
