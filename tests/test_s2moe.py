"""S2-MoE's self-drafter (drafters/s2moe.py, `--drafter s2moe:K'`): the MoE target routing K' < K
experts a token drafts over the target's own cache. Greedy speculative output equals plain on
Qwen3-MoE (top 2 of 8, renormalised) and OLMoE (top 3 of 6, not renormalised), chains and trees,
and a Mixtral with a 16-token window (its sliding layers' rings) with a tree;
the draft really routes fewer experts (its logits differ from the target's, and renorm changes
them); its rows are rolled back before verification (lengths back to the committed prefix, the
prefix's rows untouched; a drafter that skips the roll-back breaks exactness); a dense target is
refused in one line. Tiny random configs saved by transformers (test_moe_families's)."""

from __future__ import annotations

import pytest
import torch

from outrider.drafters.registry import parse_drafter
from outrider.drafters.s2moe import S2MoeDrafter
from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.errors import ConfigError
from outrider.models.moe_layer import fewer_experts, route
from outrider.sampling import SamplingParams
from outrider.weights.loader import load_decoder
from test_moe_families import PROMPT, save
from tiny import logits_in_steps, make_tiny

NAMES = ("qwen3-moe", "olmoe", "mixtral-window")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    torch.set_num_threads(1)
    out = {}
    for name in NAMES:
        folder = tmp_path_factory.mktemp(name)
        save(name, folder)
        out[name] = folder, load_decoder(folder, "cpu", torch.float32)
    return out


def _requests():
    return [Request(PROMPT, 24, SamplingParams(0.0)), Request(PROMPT[3:] + [60, 61], 17, SamplingParams(0.0))]


def _run(models, name, spec, tree, control="fixed:3"):
    folder, model = models[name]
    plain = [c.token_ids for c in generate_ids(model, _requests(), set())]
    speculator = Speculator.build(SpecOptions(spec, tree, control), model, folder)
    done = generate_ids(model, _requests(), set(), speculation=speculator)
    return plain, [c.token_ids for c in done], done


@pytest.mark.parametrize("name, spec, tree", [
    ("qwen3-moe", "s2moe:1", "chain"), ("olmoe", "s2moe:2", "chain"), ("olmoe", "s2moe:1,renorm", "chain"),
    ("qwen3-moe", "s2moe:1", "static:2,2,1"), ("olmoe", "s2moe:2", "dynamic:2,5"),
    ("mixtral-window", "s2moe:1", "static:2,1"),  # sliding layers: the draft's rows in rings
])
def test_greedy_equals_plain(models, name, spec, tree):
    plain, spec_out, done = _run(models, name, spec, tree)
    assert spec_out == plain
    assert done[0].stats["mean_accepted_length"] > 1  # the self-draft is accepted, not only the bonus


def test_the_draft_routes_fewer_experts(models):
    """route() under fewer_experts: K' experts a row, the target's K's best K'; renormalised where
    the model renormalises or renorm asks (OLMoE does not)."""
    model = models["olmoe"][1]
    cfg, w = model.config.moe, next(layer.moe for layer in model.layers if layer.moe is not None)
    x = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    full_w, full_e = route(x, w.router, cfg)  # [5, 3]
    with fewer_experts(2):
        w2, e2 = route(x, w.router, cfg)  # [5, 2]
    with fewer_experts(2, renormalise=True):
        wr, er = route(x, w.router, cfg)
    assert full_e.shape == (5, 3) and e2.shape == (5, 2) and torch.equal(e2, full_e[:, :2]) and torch.equal(er, e2)
    assert torch.equal(w2, full_w[:, :2]) and float(w2.sum(-1).max()) < 0.999
    assert torch.allclose(wr.sum(-1), torch.ones(5)) and torch.equal(route(x, w.router, cfg)[1], full_e)
    # and the whole forward (whatever product path the decoder picks) drafts with fewer experts
    full = logits_in_steps(model, torch.tensor(PROMPT), [0, len(PROMPT)])  # [T, vocab]
    with fewer_experts(1):
        skip = logits_in_steps(model, torch.tensor(PROMPT), [0, len(PROMPT)])
    assert not torch.allclose(full, skip, atol=1e-3)


def _drafter_over_target_cache(models, name, spec, drafter_cls=S2MoeDrafter):
    """A drafter attached to a fresh target cache whose slot 0 holds the prompt's rows (as the
    engine's prefill leaves them); returns (drafter, cache, target)."""
    folder, model = models[name]
    entry, argument = parse_drafter(spec)
    from outrider.models.batch import pack
    from outrider.spec.shapes import parse_shape

    drafter = drafter_cls(model, parse_shape("chain"), *argument)
    cache = model.new_cache(1, 64)
    batch = pack([0], [0], [torch.tensor(PROMPT[:-1])], logits="none", scratch_row=cache.scratch_row,
                 device=model.device)
    model.forward(batch, cache)
    cache.set_length(0, len(PROMPT) - 1)
    drafter.attach_target_cache(cache)
    drafter.start(7, PROMPT, SamplingParams(0.0), target_slot=0)
    return drafter, cache, model


def test_the_drafts_rows_are_rolled_back(models):
    """After a proposal the slot's length is the committed prefix again and the prefix's rows are
    the target's; the draft's own rows differ from what the target writes there (K' experts)."""
    drafter, cache, model = _drafter_over_target_cache(models, "qwen3-moe", "s2moe:1")
    n = len(PROMPT) - 1
    before = [k[0, :, :n].clone() for k in cache.k]
    from outrider.spec.types import Budget

    tree = drafter.propose(7, PROMPT, Budget(depth=3, nodes=3))
    assert len(tree.tokens) == 4 and cache.lengths[0] == n
    assert all(torch.equal(k[0, :, :n], b) for k, b in zip(cache.k, before))


class _KeepsItsRows(S2MoeDrafter):
    """The mutant: the draft's rows stay held (no roll-back), as an appending cache without seq_rm."""

    def _roll_back(self, committed):
        pass


def test_a_drafter_without_the_roll_back_is_caught(models, monkeypatch):
    drafter, cache, model = _drafter_over_target_cache(models, "qwen3-moe", "s2moe:1", _KeepsItsRows)
    from outrider.spec.types import Budget

    drafter.propose(7, PROMPT, Budget(depth=3, nodes=3))
    assert cache.lengths[0] != len(PROMPT) - 1
    import outrider.drafters.s2moe as s2moe

    monkeypatch.setattr(s2moe.S2MoeDrafter, "_roll_back", _KeepsItsRows._roll_back)
    plain, spec_out, _ = _run(models, "qwen3-moe", "s2moe:1", "chain")
    assert spec_out != plain


def test_refusals_are_one_line(models, tmp_path):
    make_tiny("llama", tmp_path)
    dense = load_decoder(tmp_path, "cpu", torch.float32)
    for spec, model, folder, words in [
        ("s2moe:1", dense, tmp_path, "no MoE layers"),
        ("s2moe:2", models["qwen3-moe"][1], models["qwen3-moe"][0], "K' below that"),
    ]:
        with pytest.raises(ConfigError) as err:
            Speculator.build(SpecOptions(spec, "chain", "fixed:3"), model, folder)
        assert words in str(err.value) and "\n" not in str(err.value)
    for bad in ("s2moe", "s2moe:0", "s2moe:x", "s2moe:1,norm"):
        with pytest.raises(ConfigError):
            parse_drafter(bad)
