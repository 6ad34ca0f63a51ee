"""The batch verify-cost table and the cost controller's batch rule: speculation backs off as
the batch's verify forward gets dearer, and what is committed never changes."""

import json

import pytest
import torch

from outrider.control import batch_cost
from outrider.control.batch_cost import BatchCostProfile, batch_grid, load_or_measure_batch
from outrider.control.controllers import FixedController
from outrider.control.cost import CostController
from outrider.control.profile import VerifyCostProfile
from outrider.llm import LLM
from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.weights.loader import load_decoder
from outrider.engine.loop import EngineLoop
from outrider.spec.types import DraftTree, VerifyResult

# Shaped like the Xeon's SmolLM2 table (batch_cost.py): wide rounds are cheap for one sequence,
# dear for 32.
XEON = BatchCostProfile((1, 4, 8, 16, 32), (1, 2, 4, 8),
                        ((0.098, 0.107, 0.124, 0.140), (0.131, 0.153, 0.209, 0.280),
                         (0.170, 0.212, 0.271, 0.380), (0.224, 0.291, 0.400, 0.580),
                         (0.320, 0.413, 0.602, 0.990)))
ONE = VerifyCostProfile((1, 2, 4, 8), (0.098, 0.107, 0.124, 0.140))


def observe_chains(ctl, seq, depth, accepted, rounds=30):
    """`rounds` chain rounds of `depth` drafts; accepted: a count, or counts taken in turn."""
    ctl.start(seq)
    tree = DraftTree.chain(0, list(range(1, depth + 1)))
    counts = accepted if isinstance(accepted, list) else [accepted]
    for r in range(rounds):
        k = counts[r % len(counts)]
        ctl.observe(seq, tree, VerifyResult(list(range(1, k + 1)), list(range(k + 1))))


def test_table_interpolates_and_is_monotone():
    p = BatchCostProfile((1, 4), (1, 2, 4), ((1.0, 1.2, 1.1), (2.0, 1.5, 3.0)))  # dips are noise
    assert p.seconds == ((1.0, 1.2, 1.2), (2.0, 2.0, 3.0))
    assert p.cost(1, 1) == 1.0 and p.cost(4, 4) == 3.0
    assert p.cost(2, 1) == pytest.approx(1.0 + 1.0 / 3)  # linear in the batch
    assert p.cost(4, 3) == pytest.approx(2.5)  # linear in the width
    assert p.cost(4, 6) == pytest.approx(4.0)  # beyond the grid: the last slope
    assert p.cost(8, 1) == pytest.approx(2.0 + 4 / 3)
    assert BatchCostProfile.from_json(json.loads(json.dumps(p.to_json()))) == p
    with pytest.raises(ValueError):
        BatchCostProfile.from_json({"batches": [1, 2], "widths": [1], "seconds": [[1.0]]})
    assert batch_grid(1) == (1,) and batch_grid(16) == (1, 2, 4, 8, 16) and batch_grid(20)[-1] == 32


def test_batch_rule_backs_off_as_the_batch_grows():
    ctl = CostController(ONE, max_depth=8, batch_profile=XEON)
    for s in range(32):
        observe_chains(ctl, s, 6, [0, 0, 0, 1], rounds=32)  # the first draft accepted a quarter of the time
    chain = lambda d: d  # noqa: E731 - a chain: nodes == depth
    assert ctl.budget(0).depth >= 1  # one sequence: a second token costs 9% more, worth 25% more
    depth_at = {b: ctl.budgets(list(range(b)), b, chain)[0].depth for b in (2, 4, 32)}
    assert depth_at[2] >= 1 and depth_at[4] >= 1
    assert depth_at[32] == 0  # 32 sequences: a second token each costs 29% more
    # every drafting sequence of a round gets the same budget
    assert len({(b.depth, b.nodes) for b in ctl.budgets(list(range(8)), 8, chain)}) == 1


def test_batch_rule_stops_drafting_that_cannot_pay():
    ctl = CostController(ONE, max_depth=8, batch_profile=XEON)
    for s in range(32):
        observe_chains(ctl, s, 4, 0)  # nothing accepted
    assert ctl.budgets(list(range(32)), 32, lambda d: d)[0].depth == 0
    good = CostController(ONE, max_depth=8, batch_profile=XEON)
    for s in range(32):
        observe_chains(good, s, 8, 8)  # everything accepted: worth it even at 32
    assert good.budgets(list(range(32)), 32, lambda d: d)[0].depth >= 4


def test_batch_rule_counts_sequences_that_do_not_draft():
    # 2 drafting sequences among 32 pay for widening all 32 rows: not worth it at 0.5 acceptance
    ctl = CostController(ONE, max_depth=8, batch_profile=XEON)
    for s in range(2):
        observe_chains(ctl, s, 4, 2)
    assert ctl.budgets([0, 1], 2, lambda d: d)[0].depth >= 1
    assert ctl.budgets([0, 1], 32, lambda d: d)[0].depth == 0


def test_measured_verify_time_scales_the_table():
    ctl = CostController(ONE, batch_profile=XEON)
    for _ in range(40):
        ctl.observe_verify_time(16, 2, 3 * XEON.cost(16, 2))
    assert ctl.scale == pytest.approx(3.0, rel=0.01)
    ctl.observe_verify_time(1, 2, 100.0)  # one sequence: the single-sequence profile's scale, not the table's
    assert ctl.scale == pytest.approx(3.0, rel=0.01) and ctl.scale_one > 1.0


def test_one_sequence_keeps_the_single_sequence_rule():
    ctl = CostController(ONE, max_depth=6, batch_profile=XEON)
    observe_chains(ctl, 0, 6, 6)
    assert ctl.budgets([0], 1, lambda d: d) == [ctl.budget(0)]
    fixed = FixedController(3)
    assert fixed.budgets([0, 1], 32, lambda d: d) == [fixed.budget(0)] * 2


def test_table_measured_once_per_machine_and_cached(tiny_folders, tmp_path, monkeypatch, capsys):
    target = load_decoder(tiny_folders["llama"], "cpu")
    table = load_or_measure_batch(tiny_folders["llama"], target, tmp_path, max_batch=3)
    assert table.batches == (1, 2, 4) and len(table.seconds[0]) == len(table.widths)
    assert all(t > 0 for row in table.seconds for t in row)
    assert "measuring the batch verify-cost profile" in capsys.readouterr().err  # a server's start waits on it

    def refuse(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(batch_cost, "measure_batch", refuse)
    assert load_or_measure_batch(tiny_folders["llama"], target, tmp_path, max_batch=4) == table
    assert load_or_measure_batch(tiny_folders["llama"], target, tmp_path, max_batch=2) == table  # a larger grid covers it
    (cached,) = tmp_path.glob("batch-cost-*.json")
    cached.write_text("{broken")
    with pytest.raises(AssertionError, match="measured again"):  # damaged: measured again
        load_or_measure_batch(tiny_folders["llama"], target, tmp_path, max_batch=4)


def test_engine_with_the_batch_rule_commits_what_each_request_commits_alone(tiny_folders, tmp_path, monkeypatch, runtime):
    runtime(cache_dir=str(tmp_path))
    llm = LLM(str(tiny_folders["llama"]), drafter="ngram", controller="cost:6", device="cpu")
    ctl = llm.speculator.controller
    g = torch.Generator().manual_seed(5)
    prompts = [(torch.randint(3, 96, (4,), generator=g).tolist() * 6)[: 8 + i] for i in range(6)]
    reqs = [Request(p, 14) for p in prompts]
    engine = EngineLoop(llm.target, set(), llm.speculator, max_running=6)
    assert ctl._batch_table is not None and ctl._batch_table.batches[-1] == 8  # measured at start
    seen = []
    orig = ctl.budgets

    def spy(seq_ids, batch_size, nodes_for):
        out = orig(seq_ids, batch_size, nodes_for)
        seen.append((batch_size, out[0].depth))
        return out

    monkeypatch.setattr(ctl, "budgets", spy)
    outs = engine.run_all(reqs)
    assert any(b > 1 for b, _ in seen) and ctl.scale != 1.0  # the batch rule ran and was fed
    assert not ctl._seqs  # every finished request's state was dropped
    for r, f in zip(reqs, outs):
        assert f.token_ids == generate_ids(llm.target, [r], set())[0].token_ids
