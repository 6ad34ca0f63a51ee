"""The cost controller's batch rule tries one depth deeper now and then (control/cost.py,
`_Exploration`), but only where a deeper round could pay were every draft accepted: where the
batch's wider verify alone forbids it, a round that drafts nothing stays a plain round
(issue 42, item 6)."""

from outrider.control.batch_cost import BatchCostProfile
from outrider.control.cost import EXPLORE_EVERY, CostController
from outrider.control.profile import VerifyCostProfile
from outrider.spec.types import DraftTree, VerifyResult

ONE = VerifyCostProfile((1, 2, 4, 8), (0.098, 0.107, 0.124, 0.140))
# one sequence: width is nearly free; 16 sequences: 2 rows each cost 3x one row (a CPU's wide verify)
DEAR = BatchCostProfile((1, 4, 16), (1, 2, 4), ((0.10, 0.11, 0.12), (0.12, 0.14, 0.18), (0.08, 0.24, 0.48)))


def depths_over(ctl: CostController, batch: int, rounds: int) -> list[int]:
    """The batch's depth round by round, each sequence committing one token a round (no drafts
    accepted: what a round that drafts nothing or whose drafts all fail tells the controller)."""
    seqs = list(range(batch))
    for s in seqs:
        ctl.start(s)
    out = []
    for _ in range(rounds):
        depth = ctl.budgets(seqs, batch, lambda d: d)[0].depth
        out.append(depth)
        tree = DraftTree.chain(0, list(range(1, depth + 1)))
        for s in seqs:
            ctl.observe(s, tree, VerifyResult([], [0]))
    return out


def test_no_try_deeper_where_even_every_draft_accepted_could_not_pay():
    ctl = CostController(ONE, max_depth=8, batch_profile=DEAR)
    assert depths_over(ctl, 16, 6 * EXPLORE_EVERY) == [0] * (6 * EXPLORE_EVERY)  # 32 tokens for 3x: never


def test_tries_deeper_go_on_where_a_deeper_round_could_pay():
    ctl = CostController(ONE, max_depth=8, batch_profile=DEAR)
    seen = depths_over(ctl, 4, 3 * EXPLORE_EVERY)  # 4 sequences: 8 tokens for 1.17x would pay
    assert seen[0] >= 1 and seen[1] == 0  # the prior drafts, one round of rejections backs off
    assert sum(d > 0 for d in seen[1:]) >= 2  # then tries one deeper now and then
