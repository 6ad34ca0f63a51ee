"""The LOSSY verify-side expert selections: AcceptMoE (spec/acceptmoe.py, `--verifier
acceptmoe-lossy`), EdgeXpert (models/edgexpert.py, `--verifier edgexpert-lossy`) and S2-MoE's
reuse-aware gating (spec/s2moe_gate.py, `--verifier s2moe-gate-lossy`), on the shared
mechanics of models/expert_select.py. Refused by any other name, at temperature > 0 and on a dense
target; never a default nor among the lossless verifiers. With a budget covering every expert the
greedy output equals plain decoding's token for token (so the end-to-end runs can fail); with a
small one each node really routes inside its eligible set and fewer experts are read; the cover,
the prior, the coalescing groups, the prompt-wise reuse and the byte / LRU counters are checked
against hand counts and slow references. Tiny random Qwen3-MoE (top 2 of 8) saved by transformers."""

from __future__ import annotations

import random
from collections import OrderedDict
from types import SimpleNamespace

import pytest
import torch

from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.errors import ConfigError
from outrider.models.edgexpert import EdgeXpertSelection, sibling_groups
from outrider.models.expert_select import (ExpertTraffic, RowGroups, smallest_cover, smallest_cover_reference,
                                           verify_groups)
from outrider.models.moe_layer import route
from outrider.sampling import SamplingParams
from outrider.spec.acceptmoe import AcceptMoeSelection, CommitPrior
from outrider.spec.s2moe_gate import ReuseGate
from outrider.spec.types import DraftTree
from outrider.spec.verifiers import choose_verifier, lossless_names, verifier_entry
from outrider.weights.loader import load_decoder
from test_moe_families import PROMPT, save


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    torch.set_num_threads(1)
    folder = tmp_path_factory.mktemp("qwen3-moe")
    save("qwen3-moe", folder)
    model = load_decoder(folder, "cpu", torch.float32)
    plain = [c.token_ids for c in generate_ids(model, _requests(), set())]
    return folder, model, plain


def _requests():
    return [Request(PROMPT, 20, SamplingParams(0.0)), Request(PROMPT[3:] + [60, 61], 14, SamplingParams(0.0))]


def _run(qwen, verifier, tree="static:2,2,1"):
    folder, model, _ = qwen
    spec = Speculator.build(SpecOptions("s2moe:1", tree, "fixed:3", verifier=verifier), model, folder)
    done = generate_ids(model, _requests(), set(), speculation=spec)
    return [c.token_ids for c in done], verifier_entry(verifier).verify.selection, done


# -- names and refusals ---------------------------------------------------------------------------

def test_refused_without_the_lossy_name_and_never_a_default():
    for name in ("acceptmoe", "edgexpert", "acceptmoe:0.9", "edgexpert:2", "s2moe-gate", "s2moe-gate:2"):
        with pytest.raises(ConfigError, match="no such verifier"):
            SpecOptions("s2moe:1", "static:2,1", verifier=name).check()
    for name in ("acceptmoe-lossy", "edgexpert-lossy", "s2moe-gate-lossy"):
        assert name not in lossless_names() and verifier_entry(name).lossy
        assert not choose_verifier("tree", False, SamplingParams(0.0)).name.endswith("lossy")
        with pytest.raises(ConfigError, match="temperature 0"):
            SpecOptions("s2moe:1", "static:2,1", verifier=name).check_sampling(SamplingParams(0.8))
    for bad in ("acceptmoe-lossy:0", "acceptmoe-lossy:1.5", "acceptmoe-lossy:0.9,resident=0",
                "acceptmoe-lossy:x", "acceptmoe-lossy:0.9,budget=2", "edgexpert-lossy:0", "edgexpert-lossy:2,important=0",
                "edgexpert-lossy:2,resident=2", "s2moe-gate-lossy:0", "s2moe-gate-lossy:2,lambda=-1"):
        with pytest.raises(ConfigError, match="lossy"):
            verifier_entry(bad)
    dense = SimpleNamespace(config=SimpleNamespace(moe=None, mlp_kinds=("dense",)))
    for selection in (AcceptMoeSelection(), EdgeXpertSelection(), ReuseGate()):
        with pytest.raises(ConfigError, match="no MoE layers"):
            selection.check_target(dense)


# -- exact when every expert is eligible ---------------------------------------------------------

@pytest.mark.parametrize("verifier", ["acceptmoe-lossy:1", "acceptmoe-lossy:1,resident=2",
                                      "edgexpert-lossy:8,important=1", "edgexpert-lossy:8,important=1,budget=3",
                                      "s2moe-gate-lossy:8", "s2moe-gate-lossy:2,lambda=0"])
def test_every_expert_eligible_equals_plain(qwen, verifier):
    tokens, selection, done = _run(qwen, verifier)
    assert tokens == qwen[2]
    assert done[0].stats["mean_accepted_length"] > 1
    verify = selection.traffic.phases["verify"]
    assert verify.forwards > 0 and verify.distinct == verify.distinct_exact > 0


@pytest.mark.parametrize("verifier", ["acceptmoe-lossy:0.3", "edgexpert-lossy:2,important=0.25",
                                      "s2moe-gate-lossy:2,lambda=4"])
def test_a_small_budget_reads_fewer_experts(qwen, verifier):
    _, selection, _ = _run(qwen, verifier)
    verify = selection.traffic.phases["verify"]
    assert verify.forwards > 0 and verify.distinct < verify.distinct_exact
    assert verify.bytes < verify.bytes_exact and verify.bytes % verify.distinct == 0
    if verifier.startswith("edgexpert"):
        prefill = selection.traffic.phases["prefill"]
        assert prefill.forwards >= 1 and prefill.distinct < prefill.distinct_exact


def test_compare_counts_kl_and_agreement(qwen):
    folder, model, _ = qwen
    for eta, exact in ((1.0, True), (0.2, False)):
        spec = Speculator.build(SpecOptions("s2moe:1", "static:2,2,1", "fixed:3", verifier=f"acceptmoe-lossy:{eta}"),
                                model, folder)
        selection = verifier_entry(f"acceptmoe-lossy:{eta}").verify.selection
        selection.reset()
        selection.compare = True
        done = generate_ids(model, _requests()[:1], set(), speculation=spec)[0]
        q = selection.report()["quality"]
        selection.compare = False
        assert q["rows"] > q["path_rows"] > 0
        # each verify's committed rows (the root's, the accepted nodes') gave one new token each;
        # the last round may commit up to its depth (3) past the length limit
        assert len(done.token_ids) <= q["path_rows"] <= len(done.token_ids) + 3
        if exact:
            assert q["kl_mean"] == 0.0 and q["top1_agreement"] == 1.0 and q["path_top1_agreement"] == 1.0
        else:
            assert q["kl_mean"] > 1e-4 and q["path_kl_mean"] >= 0.0


# -- each node routes inside its set -------------------------------------------------------------

def test_rows_route_inside_their_eligible_set(qwen):
    model = qwen[1]
    cfg = model.config.moe
    w = next(layer.moe for layer in model.layers if layer.moe is not None)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2 * 6, model.config.hidden_size, generator=gen)  # 2 trees of up to 6 nodes, T = 6
    trees = [DraftTree(torch.arange(6), torch.tensor([-1, 0, 0, 1, 1, 2])), DraftTree(torch.arange(3), torch.tensor([-1, 0, 1]))]
    selection = AcceptMoeSelection(eta=0.4)
    selection.rows, compare = verify_groups((2, 6), trees, [True, True], lambda t: torch.zeros(t.size, dtype=torch.long),
                                            selection.prior.weights)
    assert compare.tolist() == list(range(9))
    weights, experts = selection.route(w, cfg, x)
    scores = torch.softmax(x @ w.router.T, -1)
    exact = route(x, w.router, cfg)[1]
    for g, rows in ((0, range(0, 6)), (1, range(6, 9))):
        mass = sum(selection.rows.weight[r] * scores[r] for r in rows).tolist()
        eligible = smallest_cover_reference(mass, 0.4, cfg.top_k)
        assert len(eligible) < cfg.num_experts
        for r in rows:
            assert set(experts[r].tolist()) <= eligible
            best = sorted(eligible, key=lambda e: -float(scores[r, e]))[:cfg.top_k]
            assert set(experts[r].tolist()) == set(best)
            if set(exact[r].tolist()) <= eligible:
                assert set(experts[r].tolist()) == set(exact[r].tolist())
    assert torch.equal(experts[9:], exact[9:])  # padding rows (group -1): exact
    counted = selection.traffic.phases["verify"]
    assert counted.distinct == len(set(experts[:9].reshape(-1).tolist()))  # real rows only


def test_smallest_cover_equals_its_reference():
    rng = random.Random(0)
    for trial in range(200):
        n, k = rng.randint(2, 9), 0
        k = rng.randint(1, n)
        masses = [[rng.random() ** 3 for _ in range(n)] for _ in range(3)]
        eta = rng.choice([0.2, 0.5, 0.8, 0.95, 1.0])
        cap = rng.choice([None, k, k + 1, n])
        preferred = {e for e in range(n) if rng.random() < 0.3}
        pref = torch.tensor([e in preferred for e in range(n)])
        got = smallest_cover(torch.tensor(masses), eta, k, cap, pref if trial % 2 else None)
        for g in range(3):
            want = smallest_cover_reference(masses[g], eta, k, cap, preferred if trial % 2 else frozenset())
            assert set(torch.nonzero(got[g]).flatten().tolist()) == want, (masses[g], eta, k, cap)


def test_residency_following_prefers_resident_experts(qwen):
    model = qwen[1]
    cfg = model.config.moe
    w = next(layer.moe for layer in model.layers if layer.moe is not None)
    x = torch.randn(4, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    tree = DraftTree(torch.arange(4), torch.tensor([-1, 0, 1, 2]))
    selection = AcceptMoeSelection(eta=0.3, resident=3)
    key = id(w)
    selection.traffic._lru[key] = OrderedDict((e, True) for e in (5, 6, 7))  # three resident experts
    selection.rows = verify_groups((1, 4), [tree], [True], lambda t: torch.zeros(t.size, dtype=torch.long),
                                   selection.prior.weights)[0]
    scores = torch.softmax(x @ w.router.T, -1)
    mass = sum(selection.rows.weight[r] * scores[r] for r in range(4)).tolist()
    want = smallest_cover_reference(mass, 0.3, cfg.top_k, preferred={5, 6, 7})
    _, experts = selection.route(w, cfg, x)
    assert set(experts.reshape(-1).tolist()) <= want and {5, 6, 7} <= want


# -- the prior, the groups, the reuse, the counters ----------------------------------------------

def test_commit_prior_fit_and_weights(tmp_path):
    records = [(1, 0.9, True)] * 3 + [(1, 0.9, False)] + [(1, 0.01, False)] * 4 + [(2, None, True)] + [(5, 0.3, False)] * 2
    prior = CommitPrior.fit(records, depth=2, edges=(0.05, 0.5), smoothing=0.0)
    assert prior.by_depth == (3 / 8, 1 / 3)
    assert prior.table[0] == (0.0, 3 / 8, 0.75)  # depth 1: conf 0.01 -> 0/4, none in the middle (the depth's), 0.9 -> 3/4
    assert prior.table[1][1] == 0.0  # depth 2 (deeper clipped to 2), conf 0.3: 0 of 2
    prior.save(tmp_path / "p.json")
    loaded = CommitPrior.load(tmp_path / "p.json")
    tree = DraftTree(torch.arange(4), torch.tensor([-1, 0, 1, 0]), confidence=torch.tensor([1.0, 0.9, 0.3, 0.01]))
    assert loaded.weights(tree).tolist() == [1.0, 0.75, 0.0, 0.0]
    assert loaded.weights(DraftTree(torch.arange(3), torch.tensor([-1, 0, 1]))).tolist() == pytest.approx([1, 3 / 8, 1 / 3])
    (tmp_path / "bad.json").write_text('{"edges": [0.5], "table": [[0.1]], "by_depth": [0.1]}')
    with pytest.raises(ConfigError, match="wrong shape"):
        CommitPrior.load(tmp_path / "bad.json")


def test_sibling_groups_and_coalescing(qwen):
    tree = DraftTree(torch.arange(7), torch.tensor([-1, 0, 0, 1, 2, 3, 3]))  # depths 0 1 1 2 2 3 3; lone: none
    assert sibling_groups(tree).tolist() == [-1, 0, 0, 1, 1, 2, 2]
    chain = DraftTree(torch.arange(3), torch.tensor([-1, 0, 1]))
    assert sibling_groups(chain).tolist() == [-1, -1, -1]
    model = qwen[1]
    cfg = model.config.moe
    w = next(layer.moe for layer in model.layers if layer.moe is not None)
    x = torch.randn(7, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    selection = EdgeXpertSelection(cap=3)
    selection.rows = selection.verify_rows((1, 7), [tree], [True])[0]
    _, experts = selection.route(w, cfg, x)
    exact = route(x, w.router, cfg)[1]
    assert torch.equal(experts[0], exact[0])  # the root: exact
    for rows in ((1, 2), (3, 4), (5, 6)):
        assert len(set(experts[list(rows)].reshape(-1).tolist())) <= 3


def test_prompt_wise_reuse(qwen):
    model = qwen[1]
    cfg = model.config.moe
    w = next(layer.moe for layer in model.layers if layer.moe is not None)
    x = torch.randn(2 * 8, model.config.hidden_size, generator=torch.Generator().manual_seed(4))
    selection = EdgeXpertSelection(important=0.25)
    selection.rows = selection.prefill_rows((2, 8), [8, 5], [True, False])
    _, experts = selection.route(w, cfg, x)
    exact = route(x, w.router, cfg)[1]
    scores = torch.softmax(x @ w.router.T, -1)
    important = torch.topk(scores[:8].max(-1).values, 2).indices.tolist()
    shared = set(exact[important].reshape(-1).tolist())
    for r in range(8):
        if r in important:
            assert torch.equal(experts[r], exact[r])
        else:
            assert set(experts[r].tolist()) <= shared
    assert torch.equal(experts[8:], exact[8:])  # the second prompt did not ask
    assert selection.traffic.phases["prefill"].distinct_exact == len(set(exact[:13].reshape(-1).tolist()))


def test_traffic_counts_bytes_and_lru_moves():
    traffic = ExpertTraffic(budget=2)
    for used in ([0, 1], [1, 2], [0], [0, 0]):
        t = torch.tensor([used])
        traffic.record("verify", "layer", 10, t, torch.tensor([[0, 1, 2]]))
    c = traffic.phases["verify"]
    assert (c.distinct, c.distinct_exact, c.bytes, c.bytes_exact) == (2 + 2 + 1 + 1, 12, 60, 120)
    assert (c.uses, c.misses, c.moved) == (6, 4, 40)  # 0 1 | 2 (evicts 0) | 0 (evicts 1) | hit
    assert traffic.resident("layer") == {0, 2}
    assert ExpertTraffic().resident("layer") == set()
    rows = RowGroups(torch.tensor([0, -1]), torch.ones(2), torch.tensor([True, False]), 1)
    assert rows.phase == "verify"


def test_reuse_gate_biases_toward_the_trees_best_experts(qwen):
    model = qwen[1]
    cfg = model.config.moe
    w = next(layer.moe for layer in model.layers if layer.moe is not None)
    x = torch.randn(8, model.config.hidden_size, generator=torch.Generator().manual_seed(5))  # 6 nodes, 2 padding
    tree = DraftTree(torch.arange(6), torch.tensor([-1, 0, 0, 1, 2, 3]), confidence=torch.tensor([1, .6, .3, .5, .1, .4]))
    scores = torch.softmax(x @ w.router.T, -1)
    logits = scores.log()
    g = (logits[:6] * tree.confidence[:, None]).sum(0)
    star = set(torch.topk(g, 3).indices.tolist())
    exact = route(x, w.router, cfg)[1]
    moved = 0
    for strength in (0.2, 0.5, 1.0, 2.0, 100.0):
        gate = ReuseGate(cap=3, strength=strength)
        gate.rows = gate.verify_rows((1, 8), [tree], [True])[0]
        _, experts = gate.route(w, cfg, x)
        assert torch.equal(experts[6:], exact[6:])  # padding: exact
        for r in range(6):
            top = torch.topk(logits[r], 3).values
            bias = strength * float(top[0] - top[-1])  # top-1 minus the (k+1)-th
            biased = [float(logits[r, e]) + (bias if e in star else 0.0) for e in range(cfg.num_experts)]
            want = set(sorted(range(cfg.num_experts), key=lambda e: -biased[e])[:2])
            assert set(experts[r].tolist()) == want
            moved += want != set(exact[r].tolist())
        if strength == 100.0:
            assert set(experts[:6].reshape(-1).tolist()) <= star
            assert len(set(experts[:6].reshape(-1).tolist())) < len(set(exact[:6].reshape(-1).tolist()))
    assert moved > 0


def test_generate_from_the_command_line_reports_the_selection(qwen, capsys):
    import json

    from outrider.cli import main

    folder = str(qwen[0])
    common = ["generate", "a b c a b c a b", "--model", folder, "--threads", "1", "--max-new-tokens", "12", "--json"]
    assert main(common) == 0
    plain = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "expert_selection" not in plain
    assert main(common + ["--drafter", "s2moe:1", "--tree", "static:2,1", "--verifier", "edgexpert-lossy:8,important=1"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["token_ids"] == plain["token_ids"]
    verify = out["expert_selection"]["traffic"]["verify"]
    assert verify["forwards"] > 0 and verify["distinct"] == verify["distinct_exact"]


# -- S2-MoE's routing-aware expansion (drafters/s2moe_expand.py; lossless) ------------------------

def test_expansion_trim_equals_its_reference():
    from outrider.drafters.s2moe_expand import node_experts, trim, trim_reference

    rng = random.Random(1)
    for _ in range(150):
        n = rng.randint(1, 12)
        parents = [-1] + [rng.randrange(i) for i in range(1, n)]
        conf = [1.0]
        for i in range(1, n):
            conf.append(conf[parents[i]] * rng.random())
        tree = DraftTree(torch.arange(n) + 5, torch.tensor(parents), confidence=torch.tensor(conf))
        fed = {i: {rng.randrange(6) for _ in range(2)} for i in range(n) if rng.random() < 0.7}
        experts = node_experts(tree, fed)
        for i in range(n):  # an unfed node takes its nearest fed ancestor's
            j = i
            while j not in fed and j > 0:
                j = parents[j]
            assert experts[i] == fed.get(j, set())
        cost, draft = rng.choice([0.0, 0.05, 0.3]), rng.choice([0.0, 0.1])
        got = trim(tree, experts, cost, draft)
        keep = trim_reference(tree, experts, cost, draft)
        assert got.tokens.tolist() == [t + 5 for t in keep]
        assert [keep[p] if p >= 0 else -1 for p in got.parents.tolist()] == [parents[i] for i in keep]
        if cost == draft == 0.0:
            assert keep == list(range(n))


def test_expansion_is_lossless_and_verifies_fewer_experts(qwen):
    from outrider.drafters.registry import parse_drafter

    assert parse_drafter("s2moe:1,expand=0.1,draft=0.2")[1] == (1, False, 0.1, 0.2)
    for bad in ("s2moe:1,expand=-1", "s2moe:1,expand", "s2moe:1,wide=2"):
        with pytest.raises(ConfigError, match="expansion"):
            parse_drafter(bad)
    folder, model, plain = qwen
    per_verify = {}
    for drafter in ("s2moe:1", "s2moe:1,expand=0.2"):
        spec = Speculator.build(SpecOptions(drafter, "static:3,2,1", "fixed:3", verifier="acceptmoe-lossy:1.0"),
                                model, folder)
        selection = verifier_entry("acceptmoe-lossy:1.0").verify.selection
        selection.reset()
        done = generate_ids(model, _requests(), set(), speculation=spec)
        assert [c.token_ids for c in done] == plain
        verify = selection.traffic.phases["verify"]
        per_verify[drafter] = verify.distinct / verify.forwards
    assert per_verify["s2moe:1,expand=0.2"] < per_verify["s2moe:1"]
