"""Controllers and the verify-cost profile: the arithmetic that decides how deep to draft."""

import json

import pytest

from outrider.control.controllers import AdaptiveController, FixedController, parse_controller
from outrider.control.cost import CostController
from outrider.control.profile import VerifyCostProfile, load_or_measure, measure
from outrider.errors import ConfigError
from outrider.weights.loader import load_decoder
from outrider.spec.types import DraftTree, VerifyResult


def chain_round(depth: int, accepted: int):
    tree = DraftTree.chain(0, list(range(1, depth + 1)))
    return tree, VerifyResult(list(range(1, accepted + 1)), list(range(accepted + 1)))


def test_profile_interpolates():
    p = VerifyCostProfile((1, 4, 16), (1.0, 1.3, 2.5))
    assert p.cost(1) == 1.0 and p.cost(4) == pytest.approx(1.3)
    assert p.cost(10) == pytest.approx(1.3 + 1.2 * 6 / 12)
    assert p.cost(20) == pytest.approx(2.5 + 0.1 * 4)
    noisy = VerifyCostProfile((1, 2, 3, 4), (1.0, 1.3, 1.6, 1.5))  # a dip is noise
    assert noisy.seconds == (1.0, 1.3, 1.6, 1.6)


def test_unexplored_depths_take_the_rate_of_those_drafted():
    ctl = CostController(VerifyCostProfile((1, 8), (1.0, 1.2)), max_depth=6)
    ctl.start(0)
    for _ in range(20):
        ctl.observe(0, *chain_round(1, 1))  # only depth 1 drafted so far, always accepted
    accept = ctl.acceptance(0)
    assert accept[0] > 0.9 and accept[1:] == [accept[1]] * 5 and accept[1] == pytest.approx(accept[0], abs=0.03)
    fresh = CostController(VerifyCostProfile((1, 8), (1.0, 1.2)), max_depth=6)
    fresh.start(0)
    fresh.observe(0, *chain_round(2, 2))  # one round, all accepted: likely, not certain
    assert all(0.6 < a < 0.95 for a in fresh.acceptance(0))


def test_cost_controller_drafts_deeper_when_verify_is_flat():
    flat = CostController(VerifyCostProfile((1, 16), (1.0, 1.05)), max_depth=8)
    steep = CostController(VerifyCostProfile((1, 2, 16), (1.0, 2.0, 16.0)), max_depth=8)
    good = [0.9] * 8
    assert flat.best_depth(good) == 8
    assert steep.best_depth(good) == 0  # a second token doubles the cost: drafting cannot pay
    assert flat.best_depth([0.05] * 8) < flat.best_depth(good)


def test_cost_controller_learns_acceptance():
    ctl = CostController(VerifyCostProfile((1, 4, 8), (1.0, 1.1, 1.6)), max_depth=6)
    ctl.start(0)
    for _ in range(30):
        ctl.observe(0, *chain_round(4, 0))
    low = ctl.budget(0).depth
    ctl.start(1)
    for _ in range(30):
        ctl.observe(1, *chain_round(4, 4))
    assert ctl.budget(1).depth > low


def test_a_new_sequence_starts_from_what_earlier_ones_saw():
    """Beside a costly drafter (a step costs half a target step) the 0.5 prior never pays for a
    first draft; a sequence started after others that accepted 90% drafts from its first round
    (the pooled prior), and one started after rejections does not."""
    ctl = CostController(VerifyCostProfile((1, 8), (1.0, 1.3)), max_depth=6)
    for i in range(30):  # half a target step a depth, nothing fixed
        ctl.observe_draft_time(0.5 * (1 + i % 4), 1 + i % 4)
    ctl.start(0)
    assert ctl.budget(0).depth == 0  # nothing seen yet: the prior alone does not pay
    for i in range(40):
        ctl.observe(0, *chain_round(5, 5 if i % 10 else 2))
    ctl.finish(0)
    ctl.start(1)
    assert ctl.budget(1).depth >= 3
    bad = CostController(VerifyCostProfile((1, 8), (1.0, 1.3)), max_depth=6)
    for i in range(30):
        bad.observe_draft_time(0.5 * (1 + i % 4), 1 + i % 4)
    bad.start(0)
    for _ in range(40):
        bad.observe(0, *chain_round(5, 0))
    bad.start(1)
    assert bad.budget(1).depth == 0


def test_adaptive_moves_with_hysteresis():
    ctl = AdaptiveController(max_depth=6, start=3)
    ctl.start(0)
    for _ in range(10):
        ctl.observe(0, *chain_round(ctl.budget(0).depth, ctl.budget(0).depth))
    assert ctl.budget(0).depth == 6
    for _ in range(10):
        ctl.observe(0, *chain_round(ctl.budget(0).depth, 0))
    assert ctl.budget(0).depth == 1


def test_parse_controller():
    assert isinstance(parse_controller("fixed:3"), FixedController)
    assert parse_controller("adaptive:5").max_depth == 5
    for bad in ("fixed", "fixed:x", "fast", "adaptive:0", "fixed:99"):
        with pytest.raises(ConfigError):
            parse_controller(bad)


def test_profile_measured_once_and_cached(tiny_folders, tmp_path):
    target = load_decoder(tiny_folders["llama"], "cpu")
    profile = load_or_measure(tiny_folders["llama"], target, tmp_path)
    assert len(profile.sizes) == len(profile.seconds) and all(s > 0 for s in profile.seconds)
    files = list(tmp_path.glob("verify-cost-*.json"))
    assert len(files) == 1
    raw = json.loads(files[0].read_text())
    raw["seconds"] = [7.0] * len(raw["seconds"])  # a cached profile is read back, not measured again
    files[0].write_text(json.dumps(raw))
    assert load_or_measure(tiny_folders["llama"], target, tmp_path).seconds[0] == 7.0
    assert measure is not None


def test_finished_sequences_are_forgotten():
    """A server sees an unbounded stream of requests: no state may stay behind per request."""
    for ctl in (CostController(VerifyCostProfile((1, 8), (1.0, 1.2))), AdaptiveController()):
        for s in range(50):
            ctl.start(s)
            ctl.observe(s, *chain_round(2, 1))
            ctl.finish(s)
        assert not ctl._seqs
        assert not getattr(ctl, "_explore", {})


def test_a_proposals_fixed_cost_is_not_charged_to_every_depth():
    """A draft model's proposal pays a forward over the tokens accepted since its last one whatever
    its depth, then a step a depth. Fitted apart, the fixed part does not make deeper drafts look
    dearer: beside a drafter that is always right the controller drafts deeper than when the same
    seconds are charged per depth (the speculator's old report: seconds / depth)."""
    profile = VerifyCostProfile((1, 2, 4, 8, 16), (1.0, 1.08, 1.25, 1.7, 3.0))
    fitted, per_depth = CostController(profile, max_depth=10), CostController(profile, max_depth=10)
    for i in range(40):  # fixed 0.3, 0.2 a depth (of a target step)
        d = 2 + i % 5
        fitted.observe_draft_time(0.3 + 0.2 * d, d)
    assert abs(fitted.draft_fixed_s - 0.3) < 1e-6 and abs(fitted.draft_step_s - 0.2) < 1e-6
    per_depth.draft_step_s = (0.3 + 0.2 * 2) / 2  # what seconds / depth said at depth 2
    accept = [0.95] * 10
    assert fitted.best_depth(accept) > per_depth.best_depth(accept)
    same = CostController(profile, max_depth=10)
    for _ in range(10):  # one depth only: split as if the fixed part were one step
        same.observe_draft_time(0.9, 2)
    assert abs(same.draft_step_s - 0.3) < 1e-6 and abs(same.draft_fixed_s - 0.3) < 1e-6


def test_one_sequence_verify_costs_follow_the_measured_times():
    """The draft times are measured live; when verify forwards take twice what the profile says
    (a busier machine than when it was measured), the same draft seconds are cheaper beside them
    and the controller drafts deeper than on the profile's word."""
    profile = VerifyCostProfile((1, 2, 4, 8, 16), (1.0, 1.08, 1.25, 1.7, 3.0))
    measured, unmeasured = CostController(profile, max_depth=10), CostController(profile, max_depth=10)
    for ctl in (measured, unmeasured):
        for i in range(40):
            ctl.observe_draft_time(0.6 + 0.5 * (2 + i % 3), 2 + i % 3)  # a costly drafter
    for _ in range(40):
        measured.observe_verify_time(1, 4, 2 * profile.cost(4))
    assert measured.scale_one == pytest.approx(2.0, rel=0.01) and unmeasured.scale_one == 1.0
    accept = [0.9] * 10
    assert measured.best_depth(accept) > unmeasured.best_depth(accept)
    assert measured.scale == 1.0  # the batch table's scale is its own


QWEN_PAIR = VerifyCostProfile((1, 2, 4, 8, 16), (1.0, 1.07, 1.49, 2.37, 4.2))  # the 1.5B gguf-i8, measured


def depths_chosen(ctl, rounds: int, right: bool = True) -> list[int]:
    """Run `rounds` rounds of sequence 0 beside a drafter that is always right (or always wrong)."""
    chosen = []
    for _ in range(rounds):
        d = ctl.budget(0).depth
        chosen.append(d)
        if d:
            ctl.observe_draft_time(0.35 * d, d)
            ctl.observe(0, *chain_round(d, d if right else 0))
        else:
            ctl.observe(0, DraftTree.root_only(0), VerifyResult([], [0]))
    return chosen


def test_a_depth_gone_stale_is_tried_again():
    """Depth 2 rejected for a while, so the controller drafts 1 deep and sees depth 2 no more; then
    the drafter is right at every depth: a try one deeper (every EXPLORE_EVERY rounds) and the
    unseen depth's estimate drifting to the drafted ones' rate bring it back to drafting deep."""
    from outrider.control import cost

    ctl = CostController(QWEN_PAIR, max_depth=8)
    ctl.start(0)
    for _ in range(3):
        ctl.observe_draft_time(0.35 * 2, 2)
    for _ in range(30):
        ctl.observe(0, *chain_round(2, 1))  # depth 1 right, depth 2 wrong
    assert ctl.budget(0).depth == 1
    later = depths_chosen(ctl, 300)
    assert max(later[: 2 * cost.EXPLORE_EVERY]) >= 2 and min(later[-50:]) >= 6


def test_a_draft_time_from_a_slow_spell_is_tried_again(monkeypatch):
    """Proposals timed in a busy spell (5 target steps a depth) stop drafting; no proposal, no new
    time, so without the tries (the negative control) it never drafts again once the machine is
    quiet and the drafter cheap (0.35 a depth) and right; with them it does, and deep."""
    from outrider.control import cost

    def after_a_slow_spell():
        ctl = CostController(QWEN_PAIR, max_depth=8)
        ctl.start(0)
        for _ in range(4):
            ctl.observe_draft_time(5.0, 1)
        assert ctl.budget(0).depth == 0
        return depths_chosen(ctl, 2000)

    assert max(after_a_slow_spell()[-100:]) >= 4
    monkeypatch.setattr(cost._Exploration, "depth", lambda self, best, most: best)
    assert max(after_a_slow_spell()) == 0


def test_tries_grow_rare_where_drafting_never_pays(monkeypatch):
    """Beside a drafter that is always wrong the tries one deeper back off (16, 32, ... 256 rounds
    apart): over 2,000 rounds they add at most 8 drafting rounds to those the controller makes
    without them (a depth's counts decay towards the prior, so it drafts now and then anyway)."""
    from outrider.control import cost

    def drafting_rounds() -> int:
        ctl = CostController(QWEN_PAIR, max_depth=8)
        ctl.start(0)
        for _ in range(3):
            ctl.observe_draft_time(0.35, 1)
        chosen = depths_chosen(ctl, 2000, right=False)
        assert max(chosen) == 1 and chosen[-20:] == [0] * 20
        return sum(1 for d in chosen if d)

    tried = drafting_rounds()
    monkeypatch.setattr(cost._Exploration, "depth", lambda self, best, most: best)
    assert drafting_rounds() <= tried <= drafting_rounds() + 8


def test_a_slow_first_proposal_is_not_fitted():
    """A drafter's first proposal pays its memory's first touches: fitted, one slow proposal (here
    50 steps' worth) priced every later draft out, and no draft was made again to correct it."""
    ctl = CostController(QWEN_PAIR, max_depth=8)
    ctl.observe_draft_time(50.0, 2)
    assert ctl.draft_step_s == 0.0 and ctl.draft_fixed_s == 0.0
    ctl.observe_draft_time(0.7, 2)
    assert ctl.draft_step_s == pytest.approx(0.7 / 3)
