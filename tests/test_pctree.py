"""PCTree (`--tree pctree:N`, drafters/pctree.py; issue 43 item 3): the N most probable prefixes of a
DSpark block with each node's children scored by the Markov head given that node's own token,
against the slow reference that scores every path, for the three Markov variants on a random
DSpark head; the budget and min_confidence; unlike DDTree it reads the parent; and sampling
through it with the tree walk has exactly the target's law (by enumeration and by chi-square)."""

from collections import Counter

import pytest
import torch
from dspark_fixtures import random_dspark_head
from enumerate_law import ToyModel, autoregressive_law, generate, generation_law, one_thread
from test_verify_chisquare import chi_square_p_value

from outrider.drafters.block import Block, ddtree
from outrider.drafters.pctree import pctree, pctree_reference
from outrider.errors import ConfigError
from outrider.heads.dspark.markov import MarkovHead
from outrider.sampling import SamplingParams
from outrider.spec.random import PositionalRandom
from outrider.spec.shapes import parse_shape
from outrider.spec.verify_tree import verify_tree_walk

VOCAB, GAMMA = 8, 3


def paths(tree) -> list[tuple[tuple[int, ...], float]]:
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    conf = tree.confidence.tolist()
    out, path = [], {0: ()}
    for i in range(1, len(tokens)):
        path[i] = path[parents[i]] + (tokens[i],)
        out.append((path[i], conf[i]))
    return out


@pytest.fixture(scope="module", params=["vanilla", "gated", "rnn"])
def block(request):
    """A random DSpark head's one backbone pass over a short random context: (head, U, hbar, anchor)."""
    torch.manual_seed(0)
    head = random_dspark_head(request.param, rank=4, block=GAMMA, scale=1.0, hidden=16, vocab=VOCAB, layers=1,
                              heads=2, kv_heads=1, taps=2, mask_token_id=1)
    cache = head.new_cache(1, 16)
    head.write_context(cache, 0, 0, head.fuse(torch.randn(5, 2, 16)))
    anchor = 7
    U, hbar = head.block(cache, [0], [5], torch.tensor([[anchor] + [1] * (GAMMA - 1)]))  # [1, G, V], [1, G, H]
    return head, U[0] * 3, hbar[0], anchor  # sharper logits: fewer near-ties between paths


def test_shape_parses_and_refuses():
    shape = parse_shape("pctree:16")
    assert (shape.kind, shape.max_nodes, str(shape), shape.max_drafts(7), shape.fed_nodes(7)) == \
        ("pctree", 16, "pctree:16", 16, 0)
    for bad in ("pctree", "pctree:0", "pctree:4,2", "pctree:2000"):
        with pytest.raises(ConfigError, match="pctree:N"):
            parse_shape(bad)


@pytest.mark.parametrize("nodes,depth", [(1, 3), (6, 3), (25, 3), (40, 2)])
def test_the_tree_is_the_n_best_paths_scored_per_parent(block, nodes, depth):
    head, U, hbar, anchor = block
    tree = pctree(anchor, U, hbar, head.step, head.target_ids, depth, nodes)
    got = paths(tree)
    want = pctree_reference(anchor, U, hbar, head.step, head.target_ids, depth, nodes)
    assert len(got) == min(nodes, len(want)) and len({p for p, _ in got}) == len(got)
    assert all(0 <= p < i for i, p in enumerate(tree.parents.tolist()) if i)  # parents first
    assert all(len(p) <= depth for p, _ in got)
    assert sorted(c for _, c in got) == pytest.approx(sorted(torch.tensor([s for _, s in want]).exp().tolist()),
                                                      rel=1e-4)
    assert {p for p, _ in got} == {p for p, _ in want}


def test_expansions_are_batched(block):
    """The Markov steps come in a few batched calls, not one a node (the same tree: above)."""
    head, U, hbar, anchor = block
    rows = []

    def step(base, hidden, prev, state):
        rows.append(int(prev.numel()))
        return head.step(base, hidden, prev, state)

    tree = pctree(anchor, U, hbar, step, head.target_ids, 3, 25)
    depth = [0] * tree.size
    for i in range(1, tree.size):
        depth[i] = depth[int(tree.parents[i])] + 1
    with_children = len(set(tree.parents.tolist()[1:]))  # nodes whose children were scored, at least
    assert tree.size == 26 and max(depth) == 3 and len(rows) < with_children and max(rows) > 1


def test_it_reads_the_parent_where_ddtree_does_not(block):
    """At depth 2 the Markov head's bias moves each child's distribution with its parent: PCTree's
    confidences are the per-parent ones, DDTree's (marginals) differ from them."""
    head, U, hbar, anchor = block
    tree = pctree(anchor, U, hbar, head.step, head.target_ids, 2, 12)
    block2 = Block(anchor, 0, U, hbar, vocab=VOCAB)
    marginal = dict(paths(ddtree(block2, 2, 12)))
    ours = dict(paths(tree))
    deep = [p for p in ours if len(p) == 2]
    assert deep and any(abs(ours[p] - marginal.get(p, 0.0)) > 1e-3 for p in deep)


def test_budget_and_min_confidence(block):
    head, U, hbar, anchor = block
    full = pctree(anchor, U, hbar, head.step, head.target_ids, 3, 30)
    assert full.size == 31 and pctree(anchor, U, hbar, head.step, head.target_ids, 0, 5).size == 1
    floor = float(full.confidence[10])
    cut = pctree(anchor, U, hbar, head.step, head.target_ids, 3, 30, min_confidence=floor)
    assert bool((cut.confidence[1:] >= floor).all()) and cut.size < full.size
    assert paths(cut) == [x for x in paths(full) if x[1] >= floor][: cut.size - 1]


# -- sampling through the tree: exact --------------------------------------------------------------
PROMPT, LENGTH, RUNS, BOUND = [0, 1], 2, 400, 1e-4
TARGET, DRAFTER = ToyModel(3, seed=1), ToyModel(3, seed=2)
PARAMS = SamplingParams(temperature=1.0)


def toy_proposer(variant: str, nodes: int = 5):
    """A DSpark-like toy: base logits of 3 positions from a toy drafter (computed once per round, as
    one backbone pass), a random Markov head over its 3 tokens, PCTree over both."""
    markov = MarkovHead(variant, 3, 4, 3, seed=5)
    with torch.no_grad():
        for p in markov.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(9)) * 1.5)

    def step(base, hidden, prev, state):
        bias, state = markov.step(prev, hidden, state)
        return base.float() + bias.float(), state

    def propose(committed, rng):
        context, rows = list(committed), []
        for _ in range(3):
            rows.append(DRAFTER.logits(context).float())
            context.append(int(rows[-1].argmax()))
        hidden = torch.linspace(-1, 1, 12).view(3, 4)
        return pctree(committed[-1], torch.stack(rows), hidden, step, lambda ids: ids, 3, nodes)

    return propose


@pytest.mark.parametrize("variant", ["vanilla", "rnn"])
def test_sampled_law_is_the_targets_by_enumeration(variant):
    with one_thread():
        law = generation_law(PROMPT, LENGTH, TARGET, toy_proposer(variant), verify_tree_walk, PARAMS)
    want = autoregressive_law(PROMPT, LENGTH, TARGET, PARAMS)
    assert set(law) == set(want) and all(law[k] == pytest.approx(want[k], abs=1e-6) for k in want)


def test_sampled_law_passes_chi_square():
    propose = toy_proposer("gated")
    with one_thread():
        counts = Counter(generate(PROMPT, LENGTH, PositionalRandom(1234 + r), TARGET, propose, verify_tree_walk, PARAMS)
                         for r in range(RUNS))
    assert chi_square_p_value(counts, autoregressive_law(PROMPT, LENGTH, TARGET, PARAMS), RUNS) > BOUND


# -- in the engine: --drafter dspark --tree pctree:N -----------------------------------------------
ENGINE_PROMPTS = [[3, 4, 5, 3, 4, 5, 3], [6, 7, 3, 6, 7, 3, 6], [5], [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4]]


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    from tiny import make_tiny

    from outrider.weights.loader import load_decoder

    with one_thread():
        yield load_decoder(make_tiny("llama", tmp_path_factory.mktemp("pctree") / "t", vocab=8, layers=4), "cpu")


@pytest.mark.parametrize("tree", ["pctree:6", "ddtree:6"])
def test_greedy_and_seeded_sampling_equal_plain_in_the_engine(tiny_target, tree):
    from outrider.control.controllers import FixedController
    from outrider.drafters.dspark import DSparkDrafter
    from outrider.engine.generate import generate_ids
    from outrider.engine.request import Request
    from outrider.engine.speculator import SpecOptions, Speculator
    from outrider.spec.verifiers import VERIFIERS

    target = tiny_target
    head = random_dspark_head("rnn", rank=4, block=4, hidden=64, vocab=8, layers=2, heads=4, kv_heads=2, taps=3,
                              seed=3, embed=target.embed, lm_head=target.lm_head, mask_token_id=0)
    shape = parse_shape(tree)
    drafter = DSparkDrafter(head, shape, head.config.taps(target.config.num_layers))
    spec = Speculator(SpecOptions("dspark:x", tree, "fixed:3"), drafter, FixedController(3), shape)
    assert spec.verifier_for(SamplingParams()) is VERIFIERS["greedy_tree"].verify

    def run(speculation, params=SamplingParams()):
        done = generate_ids(target, [Request(list(p), 16, params) for p in ENGINE_PROMPTS], set(),
                            speculation=speculation)
        return [f.token_ids for f in done], done

    with one_thread():
        fast, done = run(spec)
        assert fast == run(None)[0]
        assert sum(f.round_stats.committed for f in done) > sum(f.round_stats.rounds for f in done)
        params = SamplingParams(temperature=1.0, seed=5)
        assert run(spec, params)[0] == run(None, params)[0]
    assert drafter.max_nodes(7) == 6
    with pytest.raises(ConfigError, match="schedule=on cuts chains"):
        DSparkDrafter(head, shape, (1, 2), sps=lambda b: 1.0)
