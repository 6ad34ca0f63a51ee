"""Greedy speculative output is the greedy autoregressive output, token for token, for every
drafter and tree shape (tiny random models; the drafts themselves may be good or bad)."""

import pytest
import torch

from outrider.control.controllers import AdaptiveController, FixedController
from outrider.control.cost import CostController
from outrider.control.profile import VerifyCostProfile
from outrider.drafters.model import ModelDrafter
from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.weights.loader import load_decoder
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.spec.shapes import parse_shape

SHAPES = ["chain", "static:2,2,1", "static:3,1,1,1", "dynamic:3,8"]


def prompts():
    g = torch.Generator().manual_seed(5)
    base = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (1, 7)]
    return base + [[10, 11, 12, 13, 10, 11, 12, 13, 10, 11]]  # a repeat, so lookups find matches


def speculator(drafter, shape="chain", controller=None):
    options = SpecOptions(drafter.name, shape, "fixed:4")
    return Speculator(options, drafter, controller or FixedController(4), parse_shape(shape))


def run(target, spec=None, n=16):
    return [f.token_ids for f in generate_ids(target, [Request(p, n) for p in prompts()], set(), speculation=spec)]


@pytest.fixture(scope="module")
def target(tiny_folders):
    return load_decoder(tiny_folders["llama"], "cpu")


@pytest.fixture(scope="module")
def plain(target):
    return run(target)


@pytest.mark.parametrize("shape", SHAPES)
def test_early_exit(target, plain, shape):
    spec = speculator(ModelDrafter(target, parse_shape(shape), num_layers=1, name="early-exit:1"), shape)
    assert run(target, spec) == plain


@pytest.mark.parametrize("shape", SHAPES)
def test_early_exit_over_the_target_cache(target, plain, shape, monkeypatch):
    """Early exit as the engine runs it: drafting over the target's own K/V, no prompt prefill of its own."""
    drafter = ModelDrafter(target, parse_shape(shape), num_layers=1, name="early-exit:1", share_target_cache=True)
    fed = []
    forward = target.forward

    def spy(batch, cache, num_layers=None):
        if num_layers == 1:
            fed.append(int(batch.tokens.shape[1]))
        return forward(batch, cache, num_layers)

    monkeypatch.setattr(target, "forward", spy)
    assert run(target, speculator(drafter, shape)) == plain
    assert drafter.target_cache is not None and drafter._slots is None  # no cache of its own was made
    assert fed and max(fed) <= 1 + parse_shape(shape).fed_nodes(4)  # roots and drafts: no prompt (10 tokens)
    drafter.start(99, [1, 2, 3], target_slot=0)  # left behind by an interrupted run
    spec = speculator(drafter, shape)
    assert run(target, spec) == plain and 99 not in drafter._states  # the next engine drops it


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("shared", [False, True], ids=["own-cache", "target-cache"])
def test_self_draft_accepts_everything(target, plain, shape, shared):
    """The target drafting for itself: every draft is accepted, so every commit path is exercised
    (over the target's own cache: only if the drafter reads the committed rows right)."""
    spec = speculator(ModelDrafter(target, parse_shape(shape), name="self", share_target_cache=shared), shape)
    outs = generate_ids(target, [Request(p, 16) for p in prompts()], set(), speculation=spec)
    assert [f.token_ids for f in outs] == plain
    # fixed:4 drafts 4 deep and all is accepted, 5 tokens a round (dynamic:3,8 keeps the 8 best
    # nodes: 2 deep, 3 a round); the last round is cut to the 16 tokens asked for, and only the
    # tokens kept count as committed
    per_round = 3 if shape.startswith("dynamic") else 5
    for f in outs:
        assert f.round_stats.committed == 16 and f.round_stats.rounds == -(-16 // per_round)


@pytest.mark.parametrize("shape", ["chain", "static:2,2"])
def test_independent_draft_model(tiny_folders, target, plain, shape):
    draft = load_decoder(tiny_folders["llama-draft"], "cpu")
    spec = speculator(ModelDrafter(draft, parse_shape(shape), name="draft-model:tiny"), shape)
    assert run(target, spec) == plain


def test_controllers_keep_output(target, plain):
    profile = VerifyCostProfile((1, 4, 16), (1.0, 1.1, 2.0))
    for controller in (AdaptiveController(max_depth=6), CostController(profile, max_depth=6), FixedController(0)):
        spec = speculator(ModelDrafter(target, parse_shape("chain"), num_layers=2, name="early-exit:2"),
                          controller=controller)
        assert run(target, spec) == plain


@pytest.mark.parametrize("depth", [2, 6])
def test_training_free_drafters(target, plain, depth):
    from outrider.drafters.ngram import NgramDrafter
    from outrider.drafters.suffix import SuffixDrafter

    for drafter in (NgramDrafter(), SuffixDrafter()):
        outs = generate_ids(target, [Request(p, 16) for p in prompts()], set(),
                            speculation=speculator(drafter, controller=FixedController(depth)))
        assert [f.token_ids for f in outs] == plain
        assert sum(f.round_stats.committed for f in outs) > sum(f.round_stats.rounds for f in outs)  # the repeat is found
