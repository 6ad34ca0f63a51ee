"""A round in which the controller backs off costs what plain decoding does (issue 42, item 6): a
drafter that catches up from the committed tokens (capability catches_up: suffix, ngram) is not
followed where it proposed nothing, and its next proposal catches up; the output stays the plain
output, and the drafts after a pause are the drafts of a drafter followed every round."""

from __future__ import annotations

import pytest

from outrider.control.controllers import FixedController
from outrider.drafters.ngram import NgramDrafter
from outrider.drafters.suffix import SuffixDrafter
from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.spec.shapes import parse_shape
from outrider.spec.types import Budget
from outrider.weights.loader import load_decoder

PROMPTS = [[10, 11, 12, 13, 10, 11, 12, 13, 10, 11], [5, 6, 7, 5, 6, 7, 5, 6], [20, 21, 22, 23, 24, 20, 21]]


class Pausing(FixedController):
    """Depth 4, but nothing on rounds `pause` of every 3 (a cost controller backing off)."""

    def __init__(self, pause: tuple[int, ...] = (1, 2)):
        super().__init__(4)
        self.round, self.pause, self.drafting = 0, pause, 0

    def budgets(self, seq_ids, batch_size, nodes_for):
        self.round += 1
        depth = 0 if self.round % 3 in self.pause else 4
        self.drafting += depth > 0
        return [Budget(depth=depth, nodes=nodes_for(depth) if depth else 0)] * len(seq_ids)


@pytest.fixture(scope="module")
def target(tiny_folders):
    return load_decoder(tiny_folders["llama"], "cpu")


def run(target, drafter, controller, calls: list | None = None):
    if calls is not None:
        update = drafter.update_batch
        drafter.update_batch = lambda ids, results, hidden: calls.append(len(ids)) or update(ids, results, hidden)
    spec = Speculator(SpecOptions(drafter.name, "chain", "fixed:4"), drafter, controller, parse_shape("chain"))
    done = generate_ids(target, [Request(p, 24) for p in PROMPTS], set(), speculation=spec)
    return [c.token_ids for c in done], [c.stats["drafted"] for c in done]


@pytest.mark.parametrize("make", [SuffixDrafter, NgramDrafter])
def test_a_round_that_drafts_nothing_does_not_follow_a_drafter_that_catches_up(target, make):
    plain = [c.token_ids for c in generate_ids(target, [Request(p, 24) for p in PROMPTS], set())]
    calls, controller = [], Pausing()
    out, drafted = run(target, make(), controller, calls)
    assert out == plain and sum(drafted) > 0
    # followed only in the rounds that drafted (a third of them), never in the others
    assert 0 < len(calls) <= controller.drafting < controller.round - 4


def test_the_drafts_after_a_pause_are_those_of_a_drafter_followed_every_round(target):
    """A paused suffix drafter, caught up at its next proposal, drafts what one updated every
    round drafts: the same trees, so the same acceptance."""
    followed, skipped = SuffixDrafter(), SuffixDrafter()
    _, a = run(target, followed, Pausing())
    skipped.capabilities = type(skipped.capabilities)(trees=skipped.capabilities.trees, catches_up=False)
    _, b = run(target, skipped, Pausing())
    assert a == b
