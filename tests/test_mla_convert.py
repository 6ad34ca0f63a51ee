"""The MHA2MLA conversion (train/mla_convert.py) and FunctionalMLA's reconstruction
(train/mla_reconstruct.py) on a small random Qwen2 saved by transformers (Q/K/V biases, GQA):
kept whole (every RoPE frequency, full rank) the converted `Mha2MlaForCausalLM` gives the source's
logits in the runtime, in a prefill and in decode steps; partial RoPE and a low rank change them
(the conversion's error); the trainable module computes what the runtime's latent layer computes;
reconstruction lowers a layer's held-out error; and greedy speculation on the converted model is
exact."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.models.batch import pack
from outrider.models.layers import rms_norm, swiglu_mlp
from outrider.sampling import SamplingParams
from outrider.train.mla_convert import convert, head_dims
from outrider.train.mla_reconstruct import MlaAttention, Sizes, nmse, reconstruct, source_attention
from outrider.weights.loader import load_decoder
from tiny import add_tokenizer

TOKENS = torch.randint(3, 96, (40,), generator=torch.Generator().manual_seed(1))
SIZES = Sizes(heads=4, kv_heads=2, head_dim=16, theta=1000.0)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    import transformers as tf

    folder = tmp_path_factory.mktemp("qwen2")
    config = tf.Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                            rope_parameters={"rope_type": "default", "rope_theta": 1000.0}, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = tf.Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # larger weights, and biases far from 0, so that each is read
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else p.normal_(0.0, 0.5)
    model.save_pretrained(folder)
    add_tokenizer(folder)
    raw = json.loads((folder / "config.json").read_text())
    return folder, raw, load_file(folder / "model.safetensors"), logits(load_decoder(folder, "cpu", torch.float32))


def logits(model, cuts=(0, 40)) -> torch.Tensor:
    cache = model.new_cache(1, 64)
    rows = []
    for start, stop in zip(cuts, cuts[1:]):
        rows.append(model.forward(pack([0], [start], [TOKENS[start:stop]], scratch_row=cache.scratch_row), cache).logits[0])
        cache.set_length(0, stop)
    return torch.cat(rows)


def converted(source, folder, rank, pairs, keep="high"):
    tensors, raw = convert(source[2], source[1], rank, pairs, keep)
    folder.mkdir(exist_ok=True)
    save_file(tensors, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(raw))
    add_tokenizer(folder)
    return load_decoder(folder, "cpu", torch.float32), tensors, raw


def test_whole_conversion_is_the_source(source, tmp_path):
    model, _, raw = converted(source, tmp_path / "whole", rank=10 ** 6, pairs=8)
    assert raw["kv_lora_rank"] == 2 * 16 and model.config.mla.rope_heads == 2
    for cuts in ((0, 40), (0, 30, *range(31, 41))):
        got = logits(model, cuts)
        assert torch.allclose(got, source[3], atol=2e-5, rtol=1e-4), (got - source[3]).abs().max()


@pytest.mark.parametrize("rank, pairs, keep", [(10 ** 6, 2, "high"), (10 ** 6, 2, "uniform"), (16, 8, "high")])
def test_partial_rope_or_low_rank_changes_it(source, tmp_path, rank, pairs, keep):
    model, _, raw = converted(source, tmp_path / "part", rank, pairs, keep)
    assert not torch.allclose(logits(model), source[3], atol=1e-3, rtol=1e-3)
    assert raw["qk_rope_head_dim"] == 2 * pairs and model.new_cache(1, 7).bytes_per_token() == 2 * (
        raw["kv_lora_rank"] + 2 * 2 * pairs) * 4


@pytest.mark.parametrize("keep", ["high", "uniform"])
def test_at_full_rank_it_is_the_source_with_partial_rope(source, keep):
    """Partial RoPE is the conversion's one change at full rank: the converted layer computes the
    source's attention with only the kept dimensions turned (its biases, orders and SVD exact)."""
    tensors, raw = convert(source[2], source[1], 10 ** 6, 2, keep)
    prefix = "model.layers.1.self_attn."
    own = lambda d: {k[len(prefix):]: v for k, v in d.items() if k.startswith(prefix)}  # noqa: E731
    _, rope, _ = head_dims(16, 2, keep)
    rotated = torch.zeros(16, dtype=torch.bool).index_fill_(0, rope, True)
    x = torch.randn(3, 20, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = source_attention(own(source[2]), x, SIZES, rotated)
        got = MlaAttention(own(tensors), raw)(x)
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()
        assert not torch.allclose(got, source_attention(own(source[2]), x, SIZES), atol=1e-3)


def test_kept_frequencies_turn_as_the_source_turns_them():
    nope, rope, stride = head_dims(16, 2, "uniform")
    assert rope.tolist() == [0, 4, 8, 12] and stride == 4 and len(nope) == 12
    nope, rope, stride = head_dims(16, 2, "high")
    assert rope.tolist() == [0, 1, 8, 9] and stride == 1


def test_module_computes_the_runtime_layer_and_reconstruction_helps(source, tmp_path):
    model, tensors, raw = converted(source, tmp_path / "r12", rank=12, pairs=2)
    prefix = "model.layers.0.self_attn."
    own = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
    module = MlaAttention(own, raw)
    # the runtime's hidden state after layer 0 from the module's attention and the source's MLP
    cache = model.new_cache(1, 64)
    got = model.forward(pack([0], [0], [TOKENS], hidden_layers=(1,), scratch_row=cache.scratch_row), cache).hidden[1]
    w = model.layers[0]
    x = model.embed[TOKENS][None]  # [1, T, E]
    with torch.no_grad():
        x = x + module(rms_norm(x, w.input_norm, 1e-6))
        x = x + swiglu_mlp(rms_norm(x, w.post_norm, 1e-6), w.gate_up, w.down)
    assert torch.allclose(got, x, atol=1e-4, rtol=1e-4), (got - x).abs().max()
    # reconstruction on random normed inputs of a decaying spectrum (as real hidden states have: the
    # weights' SVD is already the best rank-r fit for isotropic inputs): the held-out error falls
    source_w = {k[len(prefix):]: v for k, v in source[2].items() if k.startswith(prefix)}
    g = torch.Generator().manual_seed(2)
    mix = torch.randn(64, 64, generator=g) * (0.85 ** torch.arange(64.0))[:, None]
    xs = rms_norm(torch.randn(48, 24, 64, generator=g) @ mix, torch.ones(64), 1e-6)
    with torch.no_grad():
        ys = source_attention(source_w, xs, SIZES)
    before, after = reconstruct(module, xs[:40], ys[:40], xs[40:], ys[40:], steps=60, lr=3e-3, batch=8)
    assert after < 0.5 * before
    with torch.no_grad():
        assert nmse(module(xs[40:]), ys[40:]) == pytest.approx(after)


def test_speculation_on_a_converted_draft_and_target_is_exact(source, tmp_path):
    folder = tmp_path / "r12"
    model, _, _ = converted(source, folder, rank=12, pairs=2)
    requests = [Request([5, 17, 33, 8, 5, 17, 33, 9, 40, 41], 24, SamplingParams(0.0))]
    plain = [c.token_ids for c in generate_ids(model, requests, set())]
    for drafter, tree in (("suffix", "chain"), (f"draft-model:{folder}", "static:2,2,1")):
        speculator = Speculator.build(SpecOptions(drafter, tree, "fixed:3"), model, folder)
        assert [c.token_ids for c in generate_ids(model, requests, set(), speculation=speculator)] == plain
    # the converted draft for the source target: its proposals differ, the target's tokens do not
    target = load_decoder(source[0], "cpu", torch.float32)
    plain = [c.token_ids for c in generate_ids(target, requests, set())]
    speculator = Speculator.build(SpecOptions(f"draft-model:{folder}", "chain", "fixed:3"), target, source[0])
    assert [c.token_ids for c in generate_ids(target, requests, set(), speculation=speculator)] == plain
