"""GLANCE's budget tree (`--tree glance:N[,K[,E]]`, drafters/glance_tree.py; issue 44 item 4): the N
best prefix-closed nodes under the product of the block's marginals with each position's top K, the
extra pass's nodes hung off the greedy spine, greedy speculative output equal to autoregressive on a
tiny target with a random head and on SmolLM2 with the shipped DFlash head."""

import itertools
import math

import pytest
import torch
from dflash_fixtures import random_head
from enumerate_law import one_thread

from outrider.control.controllers import FixedController
from outrider.drafters.block import Block, ddtree
from outrider.drafters.dflash import DFlashDrafter
from outrider.drafters.glance_tree import SPINE_THRESHOLD, glance_tree
from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.errors import ConfigError
from outrider.sampling import SamplingParams
from outrider.spec.shapes import parse_shape
from outrider.spec.tree import depths
from outrider.spec.verifiers import VERIFIERS
from outrider.weights.loader import load_decoder

PROMPTS = [[3, 4, 5, 3, 4, 5, 3], [6, 7, 3, 6, 7, 3, 6], [5], [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4]]


def _block(logits, root=9):
    return Block(root, 0, torch.tensor(logits), torch.zeros(len(logits) + 1, 4), vocab=len(logits[0]))


def _paths(tree):
    out = []
    for i in range(1, tree.size):
        path, j = [], i
        while j > 0:
            path.append(int(tree.tokens[j]))
            j = int(tree.parents[j])
        out.append(tuple(reversed(path)))
    return out


def test_shapes_parse_and_refuse():
    assert str(parse_shape("glance:63")) == "glance:63,8" and parse_shape("glance:63").max_drafts(7) == 63
    shape = parse_shape("glance:15,4,16")
    assert (shape.max_nodes, shape.top_k, shape.extra, shape.max_drafts(7)) == (15, 4, 16, 31)
    for bad in ("glance", "glance:0", "glance:8,0", "glance:8,65", "glance:8,8,8,8"):
        with pytest.raises(ConfigError):
            parse_shape(bad)


def test_budget_tree_keeps_the_n_best_prefixes_of_each_positions_top_k():
    torch.manual_seed(0)
    block = _block(torch.randn(3, 5).mul(2).tolist())
    logp = block.logp
    for k, n in ((5, 1), (5, 7), (5, 30), (2, 5), (2, 14)):
        ranked = logp.topk(k, -1).indices.tolist()
        prefixes = [p for d in range(1, 4) for p in itertools.product(*ranked[:d])]
        score = {p: sum(float(logp[i, t]) for i, t in enumerate(p)) for p in prefixes}
        tree = glance_tree(block, 3, n, k)
        got = _paths(tree)
        best = sorted(score.values(), reverse=True)[:n]
        assert len(set(got)) == len(got) == min(n, len(prefixes))
        assert sorted((score[p] for p in got), reverse=True) == pytest.approx(best)
        assert all(0 <= p < i for i, p in enumerate(tree.parents.tolist()) if i)  # parents first
        for i, p in enumerate(got):
            assert math.isclose(float(tree.confidence[i + 1]), math.exp(score[p]), rel_tol=1e-5)
        if k == 5:  # no branch limit: DDTree's set
            assert set(got) == set(_paths(ddtree(block, 3, n)))


def test_extra_pass_hangs_its_nodes_off_the_spine_leaf_only_when_the_spine_is_confident():
    sure = [[0.0, 6.0, 0.0], [5.0, 0.0, 0.0], [0.0, 0.0, 5.0]]  # spine 1, 0, 2 with probability ~0.98
    calls = []

    def past_block(spine):
        calls.append(spine)
        return torch.tensor([[0.0, 0.0, 4.0], [3.0, 2.0, 0.0], [0.0, 1.0, 0.0]])  # [B=3, Vd]

    tree = glance_tree(_block(sure), 3, 2, 2, extra=4, past_block=past_block)
    assert calls == [[1, 0, 2]]
    paths = _paths(tree)
    assert paths[:2] == [(1,), (1, 0)] and paths[2] == (1, 0, 2)  # the budget's 2, then the spine's missing node
    assert paths[3:] == [(1, 0, 2, 2), (1, 0, 2, 2, 0), (1, 0, 2, 2, 0, 1)]  # 4 - 1 extra nodes, best-first
    assert int(depths(tree.parents).max()) == 6 and tree.size == 1 + 2 + 4
    calls.clear()
    unsure = [[0.0, 0.1, 0.0], [0.1, 0.0, 0.0], [0.0, 0.0, 0.1]]
    assert math.exp(sum(float(r.max()) for r in _block(unsure).logp)) < SPINE_THRESHOLD
    assert glance_tree(_block(unsure), 3, 2, 2, extra=4, past_block=past_block).size == 3 and not calls
    assert glance_tree(_block(sure), 2, 2, 2, extra=4, past_block=past_block).size == 3 and not calls  # block not reached


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from tiny import make_tiny

    with one_thread():
        folder = make_tiny("llama", tmp_path_factory.mktemp("glance") / "t", vocab=8, layers=4)
        yield load_decoder(folder, "cpu")


def _run(target, spec, params=SamplingParams(), n=16):
    requests = [Request(list(p), n, params) for p in PROMPTS]
    done = generate_ids(target, requests, set(), speculation=spec)
    return [f.token_ids for f in done], done


@pytest.mark.parametrize("tree", ["glance:6", "glance:6,2", "glance:4,8,6"])
def test_greedy_and_sampled_equal_plain_on_a_tiny_target(target, tree):
    head = random_head(hidden=64, vocab=8, layers=2, heads=4, kv_heads=2, block=4, taps=3, seed=3,
                       embed=target.embed, lm_head=target.lm_head, mask_token_id=0)
    shape = parse_shape(tree)
    drafter = DFlashDrafter(head, shape, head.config.taps(target.config.num_layers))
    spec = Speculator(SpecOptions("dflash:x", tree, "fixed:3"), drafter, FixedController(3), shape)
    assert spec.verifier_for(SamplingParams()) is VERIFIERS["greedy_tree"].verify
    with one_thread():
        fast, done = _run(target, spec)
        assert fast == _run(target, None)[0]
        assert sum(f.round_stats.committed for f in done) > sum(f.round_stats.rounds for f in done)
        params = SamplingParams(temperature=1.0, seed=5)
        assert _run(target, spec, params)[0] == _run(target, None, params)[0]


@pytest.mark.model
def test_shipped_dflash_head_with_glance_equals_plain_on_smollm2(smollm2_path):
    from outrider import LLM

    prompt = "def is_prime(n):\n    \"\"\"Return True if n is a prime number.\"\"\"\n"
    with one_thread():
        ar = LLM(str(smollm2_path), dtype="float32").generate(prompt, 24)
        sp = LLM(str(smollm2_path), dtype="float32", drafter="dflash:smollm2-135m-instruct,vocab=8192",
                 tree="glance:15,8,8", controller="fixed:7")
        out = sp.generate(prompt, 24)
    assert out.token_ids == ar.token_ids and out.stats["rounds"] > 0
    assert out.stats["mean_accepted_length"] > 1.5
