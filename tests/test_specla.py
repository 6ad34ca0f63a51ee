"""SpecLA's controller (control/specla.py) and its state-bytes cost model (control/specla_cost.py):
confidence pruning drops every node below the threshold with its whole subtree and keeps the rest;
the width is the one of most expected tokens a second under the cost model; the cost model's
per-node bytes are what a hybrid's state really holds per verified node. Greedy speculation with
SpecLA on a hybrid equal to plain decoding: tests/test_hybrid_eagle3.py."""

from __future__ import annotations

import pytest
import torch
from tiny import make_tiny

from outrider.control.controllers import parse_controller
from outrider.control.profile import VerifyCostProfile
from outrider.control.specla import SpecLAController, best_first, prune
from outrider.control.specla_cost import Roofline, StateBytes, calibrate
from outrider.errors import ConfigError
from outrider.models.batch import pack
from outrider.spec.types import DraftTree
from outrider.weights.loader import load_decoder


def tree(parents: list[int], confidence: list[float], probs: bool = False) -> DraftTree:
    n = len(parents)
    return DraftTree(torch.arange(10, 10 + n), torch.tensor(parents),
                     torch.full((n, 8), 1 / 8) if probs else None, torch.tensor(confidence))


def test_pruning_drops_nodes_below_the_threshold_with_their_subtrees():
    #           node: 0    1    2    3     4     5    6
    t = tree([-1, 0, 0, 1, 2, 4, 3], [1.0, 0.75, 0.25, 0.25, 0.125, 0.5, 0.375])  # exact in float32
    kept = prune(t, 0.25)
    # nodes at 0.25 stay; node 4 (0.125) goes, and with it node 5 although its own 0.5 passes
    assert kept.tokens.tolist() == [10, 11, 12, 13, 16]
    assert kept.parents.tolist() == [-1, 0, 0, 1, 3]
    assert kept.confidence.tolist() == [1.0, 0.75, 0.25, 0.25, 0.375]
    assert prune(t, 0.0).size == t.size and prune(t, 0.76).size == 1
    assert prune(tree([-1, 0, 1], [1.0, 0.2, 0.1]), 0.15).tokens.tolist() == [10, 11]  # a chain cut


def test_best_first_prefixes_are_subtrees():
    t = tree([-1, 0, 0, 1, 1, 2, 3], [1.0, 0.5, 0.4, 0.45, 0.1, 0.35, 0.4])
    order = best_first(t)
    assert order == [1, 3, 2, 6, 5, 4]
    for k in range(len(order) + 1):
        kept = {0, *order[:k]}
        assert all(int(t.parents[n]) in kept for n in kept if n)


class FlatProfile:
    sizes, seconds = (1, 32), (1.0, 1.0)


def controller(bytes_per_node: int, threshold: float = 0.0, draft_s: float = 0.0) -> SpecLAController:
    """A controller over a made-up target: 1000 weight bytes, `bytes_per_node` state bytes per
    node (all in the gated-delta state), no flops to speak of, 1000 bytes a second."""
    state = StateBytes(weight_bytes=1000, weight_params=0, delta_layers=1, attention_layers=0, HV=1, dk=0,
                       dv=bytes_per_node - 1, conv_dim=0, conv_kernel=1, state=1, act=1)
    c = SpecLAController(state, lambda: None, max_depth=6, threshold=threshold)
    c._roofline = Roofline(bandwidth=1000.0, rate=1e30)
    c._draft_mean = draft_s
    return c


def test_the_width_is_the_one_of_most_tokens_a_second():
    t = tree([-1, 0, 1, 2, 3, 4], [1.0, 0.9, 0.8, 0.5, 0.2, 0.05])
    for per_node in (1, 50, 200, 600):
        c = controller(per_node)
        got = c.size([t], 1)[0]
        # by hand: width w keeps the w - 1 best drafts; rate = (1 + their confidences) / seconds
        gains = [0.9, 0.8, 0.5, 0.2, 0.05]
        rates = [(1 + sum(gains[: w - 1])) / ((1000 + w * per_node) / 1000) for w in range(1, 7)]
        assert got.size == 1 + rates.index(max(rates)), (per_node, rates)
    assert controller(1).size([t], 1)[0].size == 6  # state nearly free: verify everything
    assert controller(600).size([t], 1)[0].size < 4  # dear state bytes: a smaller tree


def test_trim_prunes_then_sizes_and_counts():
    t = tree([-1, 0, 0, 1, 3], [1.0, 0.9, 0.2, 0.5, 0.3])
    c = controller(1, threshold=0.25)
    kept = c.trim([0], [t], 1)[0]
    assert kept.parents.tolist() == [-1, 0, 1, 2] and (c.drafted, c.pruned, c.sized_out, c.verified) == (4, 1, 0, 3)
    # dear state: of the chain 0.9, 0.5, 0.3 left, widths 1-4 give 0.63, 0.86, 0.86, 0.79 tokens a second
    c = controller(600, threshold=0.25)
    kept = c.trim([0], [t], 1)[0]
    assert kept.tokens.tolist() == [10, 11] and (c.drafted, c.pruned, c.sized_out, c.verified) == (4, 1, 2, 1)


def test_sampled_trees_are_pruned_by_families_not_by_their_own_draws():
    """With q (rejection sampling), a child's own confidence must not choose it: a family of
    siblings is kept or dropped together, on its parent's confidence and q alone."""
    c = controller(1, threshold=0.12)
    t = tree([-1, 0, 0, 1], [1.0, 0.9, 0.01, 0.5], probs=True)  # node 2 a poor draw beside node 1
    kept = c.trim([0], [t], 1)[0]
    # the root's family of 2 (gain 1 - (7/8)^2 = 0.23) kept whole; node 3's (0.9 / 8 = 0.11) not
    assert kept.size == 3 and kept.tokens.tolist() == [10, 11, 12]


def test_a_batch_shares_one_width():
    c = controller(1)
    trees = [tree([-1, 0, 1], [1.0, 0.9, 0.8]), tree([-1, 0, 1, 2, 3], [1.0, 0.9, 0.8, 0.7, 0.6])]
    got = c.size(trees, 3)
    assert [t.size for t in got] == [3, 5]


def test_calibrate_reaches_the_profiles_bounds():
    s = StateBytes(weight_bytes=1000, weight_params=10, delta_layers=0, attention_layers=0)
    profile = VerifyCostProfile((1, 2, 4), (1.0, 1.0, 1.6))
    roof = calibrate(s, profile, context=0)
    assert roof.bandwidth == pytest.approx(1000.0) and roof.rate == pytest.approx(80 / 1.6)
    assert roof.bound(s.bytes(1, 0), s.flops(1, 0)) == "memory"
    assert roof.bound(s.bytes(8, 0), s.flops(8, 0)) == "arithmetic"


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    return load_decoder(make_tiny("qwen3_5", tmp_path_factory.mktemp("specla") / "q", layers=4), "cpu", torch.float32)


def test_node_bytes_are_what_the_hybrid_holds_per_verified_node(hybrid):
    """A verify of a 5-node tree holds, per gated-delta layer and node, exactly the compact
    factors the cost model counts (models/delta_state.py); and snapshots cost more per node."""
    state = StateBytes.of_model(hybrid)
    cache = hybrid.new_cache(1, 32)
    hybrid.forward(pack([0], [0], [torch.tensor([3, 9, 4, 11, 7, 8])], logits="none",
                        scratch_row=cache.scratch_row), cache)
    cache.set_length(0, 6)
    before = cache.delta.nbytes()
    hybrid.forward(pack([0], [6], [torch.tensor([5, 6, 7, 8, 9])], [torch.tensor([-1, 0, 0, 1, 2])],
                        scratch_row=cache.scratch_row), cache)
    held = cache.delta.nbytes() - before
    attention_row = state.attention_layers * 2 * state.kv_heads * state.head_dim * state.kv
    assert held == 5 * (state.node_bytes("factors") - attention_row)
    assert state.delta_layers == 3 and state.node_bytes("snapshots") > state.node_bytes("factors")
    assert state.weight_bytes == sum(m.numel() * 4 for w in hybrid.layers for m in w.matrices) + hybrid.lm_head.numel() * 4


def test_specla_parses_and_refuses_in_one_line():
    assert parse_controller("specla").name == "specla" and parse_controller("specla").threshold == 0.05
    c = parse_controller("specla:4,0.2")
    assert (c.max_depth, c.threshold, c.name) == (4, 0.2, "specla:4,0.2")
    for bad in ("specla:0", "specla:x", "specla:4,1.5", "specla:4,-0.1", "specla:4,y"):
        with pytest.raises(ConfigError, match="specla:MAX") as err:
            parse_controller(bad)
        assert "\n" not in str(err.value)


def test_it_drafts_one_deeper_than_the_trees_it_keeps():
    deep = tree([-1, 0, 1, 2, 3, 4, 5], [1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4])
    cheap, dear = controller(1), controller(2000)  # dear: widths 1-4 give 0.33, 0.38, 0.386, 0.378
    for _ in range(20):
        cheap.trim([0], [deep], 1)
        dear.trim([0], [deep], 1)
    assert cheap.budget(0).depth == 6 and cheap.budgets([0, 1], 2, lambda d: 2 * d)[0].nodes == 12
    assert dear.last_width == 3 and dear.budget(0).depth == 3 and dear.budget(0).min_confidence == 0.0
