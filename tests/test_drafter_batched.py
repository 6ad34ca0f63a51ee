"""Batched drafting (issue 8, item 3): a model drafter drafts for the whole batch with one
forward per draft depth, and what it drafts and what is committed is what it gives for each
sequence alone.

- draft model (an independent tiny Llama) and EAGLE-3 (a tiny head), chains and trees: greedy
  output of a batch of sequences of different lengths that start and finish at different rounds
  equals greedy autoregressive output, and each sequence's output and stats equal its run alone;
- the drafter's forwards per round are counted with a wrapper: one per draft depth for the
  batch (the catch-up of the committed tokens is the first), against B per depth for the
  per-sequence reference (`batched=False`, drafters/grow.py `grow_alone`), which drafts the same;
- more sequences than the drafter cache's first slots (it grows), slots freed mid-run and
  taken again (holes in the span);
- seeded sampled chains: the same text alone and in any batch.
"""

import json
from dataclasses import replace

import pytest
from eagle3_tiny import write_eagle3
from enumerate_law import one_thread
from tiny import make_tiny

from outrider.control.controllers import FixedController
from outrider.drafters.eagle3 import Eagle3Drafter
from outrider.drafters.model import ModelDrafter
from outrider.drafters.model_growers import TreeGrowers
from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.heads.eagle3.format import load_eagle3
from outrider.weights.loader import load_decoder
from outrider.sampling import SamplingParams
from outrider.engine.loop import EngineLoop
from outrider.spec.shapes import parse_shape
from outrider.engine.speculator import SpecOptions, Speculator

PROMPTS = [[5], [3, 4, 5, 3, 4, 5, 3], [6, 7, 3, 6, 7, 3, 6, 1, 2, 3, 4, 5], [2, 7], [4, 4, 4, 1, 6]]
NEW = [9, 17, 5, 12, 7]  # each finishes at its own round


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    with one_thread():
        yield


class Counted:
    """A drafter's network with its forwards counted (everything else passes through)."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        return self.inner.forward(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class PerRound:
    """Wraps a drafter: records (sequences drafted for, forwards) of every propose_batch call."""

    def __init__(self, drafter, counted: Counted):
        self.drafter, self.counted, self.rounds = drafter, counted, []

    def propose_batch(self, seq_ids, tokens, budgets):
        before = self.counted.calls
        trees = self.drafter.propose_batch(seq_ids, tokens, budgets)
        self.rounds.append((len(seq_ids), self.counted.calls - before))
        return trees

    def __getattr__(self, name):
        return getattr(self.drafter, name)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A vocab-8 target (random drafts are often right), a second tiny model and a tiny head."""
    root = tmp_path_factory.mktemp("batched")
    folder = make_tiny("llama", root / "t", vocab=8, layers=4)
    draft = make_tiny("llama", root / "d", vocab=8, layers=2, seed=3)
    head = write_eagle3(root / "head", json.loads((folder / "config.json").read_text()), draft_vocab=6,
                        layer_ids=[0, 1, 2], semantics="sglang", seed=4)
    target = load_decoder(folder, "cpu")
    return target, load_decoder(draft, "cpu"), load_eagle3(head, target)


def drafter_of(kind, models, shape, batched=True):
    target, draft, head = models
    if kind == "draft-model":
        counted = Counted(draft)
        drafter = ModelDrafter(counted, parse_shape(shape), name="draft-model:tiny", batched=batched)
    elif kind == "early-exit":
        counted = Counted(target)
        drafter = ModelDrafter(counted, parse_shape(shape), num_layers=1, name="early-exit:1", batched=batched)
    else:
        counted = Counted(head)
        drafter = Eagle3Drafter(counted, parse_shape(shape), head.config.taps(target.config.num_layers),
                                batched=batched)
    return PerRound(drafter, counted)


def speculator(recording, shape, depth=4):
    drafter = recording.drafter
    return Speculator(SpecOptions(drafter.name, shape, f"fixed:{depth}"), recording, FixedController(depth),
                      parse_shape(shape))


def run(target, spec, indices=range(len(PROMPTS)), params=SamplingParams(), **engine):
    requests = [Request(list(PROMPTS[i]), NEW[i], params) for i in indices]
    if not engine:
        return generate_ids(target, requests, set(), speculation=spec)
    return EngineLoop(target, set(), spec, **engine).run_all(requests)


def summary(finished):
    return [(f.token_ids, f.round_stats.rounds, f.round_stats.drafted, f.round_stats.accepted_by_position) for f in finished]


@pytest.fixture(scope="module")
def plain_outputs(models) -> list[list[int]]:
    """The target's greedy output on PROMPTS without drafts: once, for every drafter and shape."""
    return [f.token_ids for f in run(models[0], None)]


CASES = [("draft-model", "chain"), ("draft-model", "static:2,2,1"), ("draft-model", "dynamic:3,6"),
         ("early-exit", "chain"), ("eagle3", "chain"), ("eagle3", "static:2,1,1"), ("eagle3", "dynamic:2,5")]


@pytest.mark.parametrize("kind,shape", CASES)
def test_batch_equals_alone_with_one_forward_per_depth(models, plain_outputs, kind, shape):
    target = models[0]
    plain = plain_outputs
    fast = drafter_of(kind, models, shape)
    together = run(target, speculator(fast, shape))
    assert [f.token_ids for f in together] == plain
    assert sum(f.round_stats.accepted_by_position[0] for f in together) > 0, "no draft accepted: nothing exercised"
    depth = parse_shape(shape).max_depth(4)
    # rounds after the first (eagle3's first has no catch-up: start wrote the prompt's rows)
    batched_rounds = [forwards for size, forwards in fast.rounds[1:] if size > 1]
    assert len(batched_rounds) >= 5 and all(forwards == depth for forwards in batched_rounds), fast.rounds
    # each sequence alone drafts (and so commits and counts) what it did in the batch
    alone = [run(target, speculator(drafter_of(kind, models, shape), shape), [i])[0] for i in range(len(PROMPTS))]
    assert summary(alone) == summary(together)
    # the per-sequence reference drafts the same, with a forward per sequence per depth
    slow = drafter_of(kind, models, shape, batched=False)
    assert summary(run(target, speculator(slow, shape))) == summary(together)
    assert sum(f for _, f in slow.rounds) > sum(f for _, f in fast.rounds)


@pytest.mark.parametrize("kind", ["draft-model", "eagle3"])
def test_requests_joining_and_leaving(models, plain_outputs, kind):
    """Two running at a time (slots freed and taken again), then all five at once on a drafter
    cache of four slots (it grows): the same output."""
    target = models[0]
    plain = plain_outputs
    recording = drafter_of(kind, models, "chain")
    spec = speculator(recording, "chain", 3)
    assert [f.token_ids for f in run(target, spec, max_running=2, chunk_size=4)] == plain
    assert [f.token_ids for f in run(target, spec, max_running=5)] == plain
    assert recording.drafter.cache.num_slots == 8
    assert max(size for size, _ in recording.rounds) == 5


@pytest.mark.parametrize("kind", ["draft-model", "eagle3"])
def test_sampled_chain_same_text_alone_and_in_a_batch(models, kind):
    target = models[0]
    params = SamplingParams(temperature=0.8, seed=7)
    spec = speculator(drafter_of(kind, models, "chain"), "chain", 3)
    together = [f.token_ids for f in run(target, spec, params=params)]
    alone = [run(target, spec, [i], params=params)[0].token_ids for i in range(len(PROMPTS))]
    assert alone == together
    reordered = [f.token_ids for f in run(target, spec, [4, 2, 0, 3, 1], params=params)]
    assert reordered == [together[i] for i in (4, 2, 0, 3, 1)]


@pytest.mark.parametrize("kind", ["draft-model", "eagle3"])
def test_sampled_siblings_same_alone_in_a_batch_and_by_the_reference(models, kind):
    """`--tree sampled:...`: siblings drawn from q by position, so a sequence drafts (and commits)
    the same alone, in a batch and with the per-sequence reference drafter."""
    target, shape = models[0], "sampled:2,2,1"
    params = SamplingParams(temperature=0.9, seed=7)
    together = run(target, speculator(drafter_of(kind, models, shape), shape, 3), params=params)
    assert sum(f.round_stats.accepted_by_position[0] for f in together) > 0, "no draft accepted: nothing exercised"
    alone = [run(target, speculator(drafter_of(kind, models, shape), shape, 3), [i], params=params)[0]
             for i in range(len(PROMPTS))]
    assert summary(alone) == summary(together)
    slow = drafter_of(kind, models, shape, batched=False)
    assert summary(run(target, speculator(slow, shape, 3), params=params)) == summary(together)


class _Budgeted:
    """Wraps a drafter: every budget it gets carries `nodes`, `min_confidence` and a chain's
    `stop` after `stop_after` drafts (the engine sizes `nodes` from the depth itself); records
    every tree."""

    def __init__(self, drafter, nodes: int, min_confidence: float = 0.0, stop_after: int | None = None):
        self.drafter, self.trees = drafter, []
        stop = None if stop_after is None else (lambda entropies: len(entropies) >= stop_after)
        self.fields = {"nodes": nodes, "min_confidence": min_confidence, "stop": stop}

    def propose_batch(self, seq_ids, tokens, budgets):
        trees = self.drafter.propose_batch(seq_ids, tokens, [replace(b, **self.fields) for b in budgets])
        self.trees += trees
        return trees

    def __getattr__(self, name):
        return getattr(self.drafter, name)


@pytest.mark.parametrize("kind", ["draft-model", "eagle3"])
def test_one_grower_honours_every_budget_field_for_every_model_drafter(models, plain_outputs, kind):
    """Issue 43: the draft model and the EAGLE-3 head grow their trees with the one grower
    (drafters/model_growers.py), so every shape honours every Budget field for both: at most
    `nodes` drafts, no node below `min_confidence` expanded, a chain stopped by `stop`; greedy
    output stays plain's."""
    target = models[0]
    plain = plain_outputs
    for shape in ("chain", "static:2,2,1", "dynamic:2,4"):
        for nodes, confidence, stop_after in ((2, 0.0, None), (3, 0.0, 1), (3, 0.5, None)):
            drafter = drafter_of(kind, models, shape).drafter
            assert isinstance(drafter, TreeGrowers)
            budgeted = _Budgeted(drafter, nodes, confidence, stop_after)
            spec = Speculator(SpecOptions(drafter.name, shape, "fixed:3"), budgeted, FixedController(3),
                              parse_shape(shape))
            assert [f.token_ids for f in run(target, spec)] == plain
            trees = budgeted.trees
            assert trees and all(tree.size - 1 <= nodes for tree in trees), (shape, nodes)
            if shape == "chain" and not confidence:  # the stop, else the budget, bounds every chain
                assert max(tree.size for tree in trees) == 1 + (stop_after or nodes)
            for tree in trees:  # a node with children was expanded: its path confidence is >= the floor
                expanded = {p for p in tree.parents.tolist()[1:] if p > 0}
                assert all(float(tree.confidence[p]) >= confidence - 1e-6 for p in expanded), (shape, tree)
