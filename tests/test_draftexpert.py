"""DraftExpert (drafters/draftexpert.py, models/draft_experts.py, train/draftexpert_train.py) on tiny
random MoEs saved by transformers (test_moe_families's Qwen2-MoE: gated shared expert, a dense
layer; Qwen3-MoE: no shared expert): greedy speculative output equals plain, chains and a tree, with
confidence and expansion truncation and with the experts behind an expert store (prefetched from the
draft's routing); the draft's MoE layer equals its term-by-term reference and differs from the
target's (top-1 routing, the draft expert counts); the draft's rows are rolled back; a short fit
lowers the residual; the file round-trips and a draft trained on another model is refused."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from outrider.drafters.draftexpert import DraftExpertArgs, DraftExpertDrafter, parse_argument
from outrider.drafters.registry import parse_drafter
from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.errors import ConfigError, ModelError
from outrider.models.draft_experts import DraftExperts, DraftLayers, draft_mlp_reference, moe_layers
from outrider.models.expert_store import ExpertStore
from outrider.models.moe_layer import moe_mlp
from outrider.sampling import SamplingParams
from outrider.train.draftexpert_train import (fit_layer, init_experts, layer_inputs, residual_targets,
                                              unexplained)
from outrider.weights.loader import load_decoder
from test_moe_families import PROMPT, save

NAMES = ("qwen2-moe", "qwen3-moe")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    torch.set_num_threads(1)
    out = {}
    for name in NAMES:
        folder = tmp_path_factory.mktemp(name)
        save(name, folder)
        model = load_decoder(folder, "cpu", torch.float32)
        experts = init_experts(model, 16, seed=1, scale=3.0)  # random, large enough to change the draft
        experts.save(folder / "draft_experts.safetensors", dtype=torch.float32)
        out[name] = folder, model, experts
    return out


def _requests():
    return [Request(PROMPT, 16, SamplingParams(0.0)), Request(PROMPT[3:] + [60, 61], 12, SamplingParams(0.0))]


def _spec(models, name, arg, tree="chain", control="fixed:3"):
    folder, model, _ = models[name]
    speculator = Speculator.build(SpecOptions(f"draftexpert:{folder / 'draft_experts.safetensors'}{arg}", tree,
                                              control), model, folder)
    return generate_ids(model, _requests(), set(), speculation=speculator), speculator


def _plain(models, name):
    return [c.token_ids for c in generate_ids(models[name][1], _requests(), set())]


@pytest.mark.parametrize("name, arg, tree", [
    ("qwen2-moe", "", "chain"), ("qwen3-moe", "", "chain"), ("qwen2-moe", ",conf=0.2,expand=3", "chain"),
    ("qwen3-moe", ",expand=0", "chain"), ("qwen2-moe", "", "static:2,2,1"),
])
def test_greedy_equals_plain(models, name, arg, tree):
    done, _ = _spec(models, name, arg, tree)
    assert [c.token_ids for c in done] == _plain(models, name)
    assert done[0].stats["mean_accepted_length"] > 1  # the draft is accepted, not only the bonus


def test_draft_layer_equals_reference_and_differs_from_target(models):
    _, model, experts = models["qwen2-moe"]
    draft = DraftLayers(experts)
    cfg1 = draft.config(model.config).moe  # top-1 routing
    x = torch.randn(7, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    for layer, w in zip(moe_layers(model), [draft.layers(model)[i] for i in moe_layers(model)]):
        target_w = model.layers[layer].moe
        fast = moe_mlp(w.moe, cfg1, x)  # [7, E]: shared and draft expert as one SwiGLU
        ref = draft_mlp_reference(target_w, model.config.moe, experts, layer, x)
        assert torch.allclose(fast, ref, atol=1e-5, rtol=1e-4)
        without = moe_mlp(target_w, cfg1, x)  # top-1 + shared: the draft expert adds something
        assert (fast - without).abs().max() > 1e-2
        assert (fast - moe_mlp(target_w, model.config.moe, x)).abs().max() > 1e-2


def test_draft_rows_rolled_back_and_rounds_counted(models):
    done, spec = _spec(models, "qwen2-moe", ",expand=0")
    drafter = spec.drafter
    assert isinstance(drafter, DraftExpertDrafter) and drafter.rounds
    assert all(r["union"] >= r["predicted"] for r in drafter.rounds)
    # expand=0: drafting stops once a draft adds any expert beyond the root's
    assert any(r["stop"] == "expand" for r in drafter.rounds)
    assert all(r["added"] == 0 or r["stop"] == "expand" or r["drafts"] <= 3 for r in drafter.rounds)


def test_skipping_the_roll_back_breaks_exactness(models, monkeypatch):
    """The mutant: the draft's rows stay held past the committed prefix (no roll-back)."""
    monkeypatch.setattr(DraftExpertDrafter, "_roll_back", lambda self, committed: None)
    done, _ = _spec(models, "qwen2-moe", "")
    assert [c.token_ids for c in done] != _plain(models, "qwen2-moe")


def test_expert_store_prefetch_from_draft_routing(models, tmp_path):
    folder, model, _ = models["qwen2-moe"]
    plain = _plain(models, "qwen2-moe")
    layers = moe_layers(model)
    saved = [(model.layers[l].moe.gate_up, model.layers[l].moe.down) for l in layers]
    store = ExpertStore(folder / "model.safetensors", model.config.num_layers, model.config.moe.num_experts, budget=3)
    try:
        for l in layers:
            model.layers[l].moe.gate_up, model.layers[l].moe.down = store.layer(l)
        done, spec = _spec(models, "qwen2-moe", "")
        assert [c.token_ids for c in done] == plain
        assert store.stats.prefetched > 0 and sum(r["hinted"] for r in spec.drafter.rounds) == store.stats.prefetched
        before = store.stats.prefetched
        done, spec = _spec(models, "qwen2-moe", ",prefetch=off")
        assert [c.token_ids for c in done] == plain and store.stats.prefetched == before
    finally:
        for l, (gu, dn) in zip(layers, saved):
            model.layers[l].moe.gate_up, model.layers[l].moe.down = gu, dn
        store.close()


def test_fit_lowers_the_residual(models):
    _, model, _ = models["qwen2-moe"]
    gen = torch.Generator().manual_seed(2)
    windows = torch.randint(3, 96, (6, 24), generator=gen)
    xs = layer_inputs(model, windows)
    layer = moe_layers(model)[0]
    r, g = residual_targets(model, layer, xs[layer])
    assert xs[layer].shape == (6 * 24, model.config.hidden_size) and float(r.abs().max()) > 0
    start = init_experts(model, 16, seed=0)
    gu, dn = fit_layer(start.gate_up[layer], start.down[layer], xs[layer], r, g, steps=150, batch=64, lr=1e-2, seed=0)
    before = unexplained(start.gate_up[layer], start.down[layer], xs[layer], r, g)
    after = unexplained(gu, dn, xs[layer], r, g)
    assert before > 0.99 and after < 0.8 * before


def test_file_round_trip_and_refusals(models, tmp_path):
    folder, model, experts = models["qwen2-moe"]
    back = DraftExperts.load(folder / "draft_experts.safetensors")
    assert sorted(back.gate_up) == moe_layers(model) == [0, 2]
    assert all(torch.equal(back.down[l], experts.down[l]) for l in back.down)
    half = tmp_path / "half.safetensors"
    experts.save(half)  # float16 by default
    assert torch.allclose(DraftExperts.load(half).gate_up[0], experts.gate_up[0], atol=1e-3)
    other = models["qwen3-moe"][1]
    with pytest.raises(ModelError, match="MoE layers|another model"):
        back.check_fits(other)
    wrong = replace(back, router=back.router + 1.0)
    with pytest.raises(ModelError, match="another model"):
        wrong.check_fits(model)
    with pytest.raises(ModelError, match="no draft-expert file"):
        DraftExperts.load(tmp_path / "none.safetensors")


def test_argument_and_refusals(models):
    assert parse_argument("") == DraftExpertArgs()
    assert parse_argument("f.safetensors,conf=0.3,expand=12,prefetch=off") == DraftExpertArgs(
        "f.safetensors", 0.3, 12, False)
    for bad in ("conf=2", "expand=-1", "prefetch=maybe", "x,y"):
        with pytest.raises(ConfigError, match="draftexpert"):
            parse_drafter(f"draftexpert:{bad}")
    entry, arg = parse_drafter("draftexpert:conf=0.1")
    dense = replace(models["qwen2-moe"][1].config, moe=None, mlp_kinds=())
    assert "no MoE layers" in entry.check_fits(arg, dense, None)
    from outrider.drafters.draftexpert import experts_file

    with pytest.raises(ConfigError, match="no shipped draft experts fit"):
        experts_file(DraftExpertArgs(), models["qwen3-moe"][1])


def test_resident_routing_reads_nothing_while_drafting(models):
    """route=resident: the draft's top-1 among resident experts, so a proposal under a store misses
    only in a layer that holds none (one read there; the default top-1 misses more); prefetch=off
    keeps the store's reads the draft's own."""
    from outrider.models.batch import pack
    from outrider.spec.shapes import parse_shape
    from outrider.spec.types import Budget

    folder, model, experts = models["qwen2-moe"]
    layers = moe_layers(model)
    saved = [(model.layers[l].moe.gate_up, model.layers[l].moe.down) for l in layers]
    warm = model.new_cache(1, 8)  # the first forward measures product paths over every weight: before the store
    model.forward(pack([0], [0], [torch.tensor(PROMPT[:2])], logits="none", scratch_row=warm.scratch_row), warm)
    misses = {}
    for route in ("top1", "resident"):
        store = ExpertStore(folder / "model.safetensors", model.config.num_layers, model.config.moe.num_experts,
                            budget=2)
        try:
            for l in layers:
                model.layers[l].moe.gate_up, model.layers[l].moe.down = store.layer(l)
            cache = model.new_cache(1, 64)
            model.forward(pack([0], [0], [torch.tensor(PROMPT[:-1])], logits="none", scratch_row=cache.scratch_row),
                          cache)
            cache.set_length(0, len(PROMPT) - 1)
            drafter = DraftExpertDrafter(model, parse_shape("chain"), experts,
                                         DraftExpertArgs(prefetch=False, resident_routing=route == "resident"))
            drafter.attach_target_cache(cache)
            drafter.start(7, PROMPT, SamplingParams(0.0), target_slot=0)
            before = store.stats.misses
            empty = sum(all(l != layer for l, _ in store.resident()) for layer in layers)  # none resident there
            tree = drafter.propose(7, PROMPT, Budget(depth=4, nodes=4))
            misses[route] = store.stats.misses - before - (empty if route == "resident" else 0)
            assert tree.size == 5 and cache.lengths[0] == len(PROMPT) - 1  # rows rolled back
        finally:
            for l, (gu, dn) in zip(layers, saved):
                model.layers[l].moe.gate_up, model.layers[l].moe.down = gu, dn
            store.close()
    assert misses["resident"] == 0 < misses["top1"]


def test_the_shipped_draft_experts():
    """The SmolLM2 MoE's draft experts: one 64-neuron expert for each of its 30 MoE layers, float16,
    under 25 MB, with the recipe that rebuilds them; named by `draftexpert:smollm2-135m-moe8`."""
    import json

    from outrider.models.draft_experts import shipped, shipped_names

    assert "smollm2-135m-moe8" in shipped_names()
    path = shipped("smollm2-135m-moe8")
    experts = DraftExperts.load(path)
    assert sorted(experts.gate_up) == list(range(30)) and experts.size == 64
    assert experts.gate_up[0].shape == (128, 576) and experts.router.shape == (8, 576)
    assert path.stat().st_size < 25 * 2**20
    recipe = json.loads((path.parent / "recipe.json").read_text())
    assert recipe["seed"] == 0 and "draftexpert_train" in recipe["command"] and len(recipe["layers"]) == 30
    assert parse_argument("smollm2-135m-moe8,conf=0.3").file == "smollm2-135m-moe8"


def test_confidence_truncation_shortens_the_drafts(models):
    _, spec = _spec(models, "qwen2-moe", "")
    _, confident = _spec(models, "qwen2-moe", ",conf=0.9")
    mean = [sum(r["drafts"] for r in s.drafter.rounds) / len(s.drafter.rounds) for s in (spec, confident)]
    assert mean[1] < mean[0]
