"""Hybrid distillation (train/distill_hybrid.py): the trainable gated-delta form against the
recurrence, the start from attention, a smoke run on a tiny Llama whose composed hybrid computes in
the runtime what the distillation trained (and speculates exactly), and the shipped
smollm2-135m-gdn: composed from the pulled SmolLM2, speculative greedy equal to plain."""

from __future__ import annotations

import json
import random

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from outrider.catalog.composed import COMPOSED, compose, pull_composed
from outrider.catalog.pull import pull
from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.models.batch import pack
from outrider.models.config import DeltaConfig
from outrider.models.gated_delta import recurrent_reference
from outrider.sampling import SamplingParams
from outrider.train import distill_hybrid
from outrider.train.delta_train import DeltaMixer, chunked_train
from outrider.train.llama_teacher import LlamaLayers
from outrider.weights.loader import load_decoder
from tiny import add_tokenizer, make_tiny


def test_chunked_train_is_the_recurrence_and_has_gradients():
    torch.manual_seed(0)
    B, H, T, dk, dv = 2, 3, 45, 8, 4  # T not a multiple of the chunk: padded
    q = F.normalize(torch.randn(B, H, T, dk), dim=-1) * dk ** -0.5
    k = F.normalize(torch.randn(B, H, T, dk), dim=-1)
    v, g, beta = torch.randn(B, H, T, dv), -torch.rand(B, H, T) * 0.5, torch.rand(B, H, T)
    v.requires_grad_(True)
    o = chunked_train(q, k, v, g, beta, chunk=16)
    for b in range(B):
        want, _ = recurrent_reference(q[b].transpose(0, 1), k[b].transpose(0, 1), v[b].detach().transpose(0, 1),
                                      g[b].T, beta[b].T, torch.zeros(H, dk, dv))
        assert torch.allclose(o[b].transpose(0, 1).double(), want, atol=1e-5)
    o.sum().backward()
    assert v.grad is not None and v.grad.abs().sum() > 0


def test_start_from_attention():
    torch.manual_seed(1)
    H, KV, D, E = 4, 2, 8, 16
    q, k, v, o = torch.randn(H * D, E), torch.randn(KV * D, E), torch.randn(KV * D, E), torch.randn(E, H * D)
    cfg = DeltaConfig(KV, KV, D, D, 4)
    m = DeltaMixer.from_attention(q, k, v, o, H, KV, cfg, 1e-5, torch.randn(E))
    assert torch.allclose(m.in_qkv[:D], (q[:D] + q[D:2 * D]) / 2)  # group 0: query heads 0 and 1
    assert torch.equal(m.in_qkv[2 * D:4 * D], k) and torch.equal(m.in_qkv[4 * D:], v)
    assert torch.allclose(m.out[:, D:2 * D], o[:, 2 * D:3 * D] + o[:, 3 * D:4 * D])
    assert torch.equal(m.conv[:, :-1], torch.zeros(cfg.conv_dim, 3)) and bool((m.conv[:, -1] > 0).all())
    with pytest.raises(ValueError):
        DeltaMixer.from_attention(q, k, v, o, H, KV, DeltaConfig(1, 1, D, D, 4), 1e-5, torch.randn(E))


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """A smoke distillation of a tiny Llama (layer 1 of 3 replaced), composed into a model folder."""
    work = tmp_path_factory.mktemp("distill")
    base = add_tokenizer(make_tiny("llama", work / "llama", layers=3))
    data = work / "data"
    data.mkdir()
    rng = random.Random(0)
    for i in range(12):
        (data / f"m{i}.py").write_text(" ".join(f"w{rng.randrange(3, 96)}" for _ in range(200)))
    summary = distill_hybrid.distill(distill_hybrid.parse(
        ["--smoke", "--base", str(base), "--out", str(work / "out"), "--data-root", str(data), "--keep-every", "2"]),
        log=lambda line: None)
    return base, work / "out", compose(base, work / "out", work / "hybrid"), summary


def test_smoke_run_writes_the_recipe_and_trains(smoke):
    base, out, folder, summary = smoke
    recipe = json.loads((out / "recipe.json").read_text())
    assert list(recipe["files"]) == ["gdn-00001-of-00001.safetensors"] and recipe["seed"] == 0
    layer = recipe["layers"]["1"]
    assert layer["val_nmse"] < layer["val_nmse_init"] <= 1.0  # the fitted start, then training
    hybrid = json.loads((folder / "config.json").read_text())
    assert hybrid["layer_types"] == ["full_attention", "linear_attention", "full_attention"]
    assert not any(".1.self_attn." in name for name in load_file(str(folder / "model.safetensors")))


def test_runtime_computes_what_was_trained(smoke):
    base, out, folder, _ = smoke
    model = load_decoder(folder, "cpu", torch.float32)
    assert model.config.layer_kinds == ("attention", "gated_delta", "attention")
    tokens = torch.tensor([3, 9, 4, 11, 7, 8, 20, 5, 3, 9, 60, 61, 62, 63, 12, 30, 31, 2, 9, 4] * 4)
    cache = model.new_cache(1, 128)
    got = model.forward(pack([0], [0], [tokens], scratch_row=cache.scratch_row), cache).logits[0]
    raw = json.loads((folder / "config.json").read_text())
    teacher = LlamaLayers(load_file(str(base / "model.safetensors")), raw)
    w = load_file(str(folder / "model.safetensors"))
    mixer = DeltaMixer(64, model.config.delta, teacher.eps)
    names = {"in_qkv": "in_proj_qkv.weight", "in_z": "in_proj_z.weight", "in_b": "in_proj_b.weight",
             "in_a": "in_proj_a.weight", "A_log": "A_log", "dt_bias": "dt_bias", "norm": "norm.weight",
             "out": "out_proj.weight"}
    with torch.no_grad():
        for attr, name in names.items():
            getattr(mixer, attr).copy_(w["model.layers.1.linear_attn." + name])
        mixer.conv.copy_(w["model.layers.1.linear_attn.conv1d.weight"][:, 0])
        x = teacher.embed[tokens][None]
        for layer in range(3):
            hn = teacher.input_norm(layer, x)
            x = teacher.mlp_block(layer, x + (mixer(hn) if layer == 1 else teacher.attention(layer, hn)))
        want = teacher.logits(x)[0]
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()


def test_speculation_on_the_smoke_hybrid_is_exact(smoke):
    _, _, folder, _ = smoke
    model = load_decoder(folder, "cpu", torch.float32)
    requests = [Request([5, 17, 33, 8, 5, 17, 33, 9], 14, SamplingParams(0.0))]
    plain = [c.token_ids for c in generate_ids(model, requests, set())]
    for drafter, tree in (("suffix", "chain"), (f"draft-model:{folder}", "static:2,2")):
        speculator = Speculator.build(SpecOptions(drafter, tree, "fixed:3"), model, folder)
        assert [c.token_ids for c in generate_ids(model, requests, set(), speculation=speculator)] == plain


@pytest.mark.model
def test_shipped_smollm2_gdn_speculates_exactly(smollm2_path):
    """`outrider models pull smollm2-135m-gdn` (composed once into the cache, as a user's pull;
    then only checked against the shipped files' sha256), loaded, speculating exactly, its own
    EAGLE-3 head included."""
    folder = pull_composed("smollm2-135m-gdn", pull, log=lambda line: None)
    assert json.loads((folder / "outrider-composed.json").read_text())["files"] == json.loads(
        (COMPOSED["smollm2-135m-gdn"][1] / "recipe.json").read_text())["files"]
    model = load_decoder(folder, "cpu", torch.float32)
    assert model.config.layer_kinds.count("attention") == 8
    requests = [Request([1, 504, 3458, 30, 2144, 30, 2517, 30], 6, SamplingParams(0.0))]
    plain = [c.token_ids for c in generate_ids(model, requests, set())]
    # trees verified by TreeWY; the EAGLE-3 head shipped for it (heads/shipped/eagle3/smollm2-135m-gdn) too
    for drafter, tree in (("suffix", "chain"), ("early-exit:4", "static:2,2"), ("eagle3:smollm2-135m-gdn", "chain"),
                          ("eagle3:smollm2-135m-gdn", "dynamic:4,12")):
        speculator = Speculator.build(SpecOptions(drafter, tree, "fixed:3"), model, folder)
        assert [c.token_ids for c in generate_ids(model, requests, set(), speculation=speculator)] == plain
