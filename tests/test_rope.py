"""RoPE types against transformers' own: a small random Llama per type (linear, llama3, yarn),
saved by transformers 5 (`rope_parameters`), runs with transformers' logits and greedy tokens,
and speculation on it is exact; a type not implemented is refused in one line."""

from __future__ import annotations

import pytest
import torch

from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.errors import ModelError
from outrider.models.batch import pack
from outrider.models.rope import RopeSpec, frequencies
from outrider.sampling import SamplingParams
from outrider.weights.loader import load_decoder
from tiny import add_tokenizer

ROPES = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    # within max_position_embeddings (256), where the engine stops: the default frequencies
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    # within the original length: the short factors, cos and sin scaled by sqrt(1 + ln 4 / ln 256)
    "longrope": {"rope_type": "longrope", "factor": 4.0, "original_max_position_embeddings": 256,
                 "short_factor": [1.0, 1.1, 1.3, 1.7, 2.2, 3.0, 4.1, 5.5],
                 "long_factor": [1.0, 2.0, 4.0, 8.0, 9.0, 10.0, 11.0, 12.0]},
}


def save(folder, rope: dict, seed: int = 0, intermediate: int = 112):
    import transformers as tf

    config = tf.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=intermediate, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                            rope_parameters={**rope, "rope_theta": 10000.0})
    torch.manual_seed(seed)
    model = tf.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0 if p.dim() > 1 else 1.0)
    model.save_pretrained(folder)
    add_tokenizer(folder)
    return model


@pytest.mark.parametrize("kind", ROPES)
def test_each_type_matches_transformers(kind, tmp_path):
    reference = save(tmp_path, ROPES[kind])
    ours = load_decoder(tmp_path, "cpu", torch.float32)
    rotary = reference.model.rotary_emb
    inv, scale = frequencies(ours.config.rope, ours.config.head_dim, ours.config.max_position_embeddings)
    assert torch.allclose(inv, rotary.inv_freq.float(), rtol=1e-6) and scale == pytest.approx(rotary.attention_scaling)
    tokens = torch.randint(3, 96, (150,), generator=torch.Generator().manual_seed(1))  # past the original 64
    with torch.no_grad():
        want = reference(tokens[None]).logits[0]
    cache = ours.new_cache(1, 160)
    got = ours.forward(pack([0], [0], [tokens], scratch_row=cache.scratch_row), cache).logits[0]
    assert torch.allclose(got, want, atol=5e-5, rtol=1e-4), (got - want).abs().max()
    prompt = tokens[:12].tolist()
    out = reference.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    plain = generate_ids(ours, [Request(prompt, 16, SamplingParams(0.0))], set())[0].token_ids
    assert plain == out[0, 12:].tolist()
    spec = Speculator.build(SpecOptions(f"draft-model:{tmp_path}", "static:2,2", "fixed:3"), ours, tmp_path)
    assert generate_ids(ours, [Request(prompt, 16, SamplingParams(0.0))], set(), speculation=spec)[0].token_ids == plain


def test_longrope_stops_where_its_short_factors_do(tmp_path):
    """Past original_max_position_embeddings transformers turns every position of a forward to the
    long factors (how the text is cut decides the output), so the context ends there."""
    rope = {**ROPES["longrope"], "original_max_position_embeddings": 64}
    rope.pop("factor")  # Phi-3's way: the ratio of the lengths, 256 / 64
    save(tmp_path, rope)
    ours = load_decoder(tmp_path, "cpu", torch.float32)
    assert ours.config.max_position_embeddings == 64
    inv, scale = frequencies(ours.config.rope, ours.config.head_dim, 256)
    assert scale == pytest.approx((1 + torch.log(torch.tensor(4.0)).item() / torch.log(torch.tensor(64.0)).item()) ** 0.5)
    done = generate_ids(ours, [Request(list(range(3, 63)), 8, SamplingParams(0.0))], set())[0]
    # positions 0..63 written; the token after the last is the fifth new one
    assert len(done.token_ids) == 64 - 60 + 1 and done.finish_reason == "context"


def test_a_type_not_implemented_is_refused_in_one_line(tmp_path):
    save(tmp_path, {"rope_type": "proportional", "factor": 2.0})
    with pytest.raises(ModelError, match=r"RoPE scaling \(rope_parameters: rope_type 'proportional'\)") as err:
        load_decoder(tmp_path, "cpu", torch.float32)
    assert "\n" not in str(err.value)


def test_the_default_is_unchanged():
    """Plain RoPE: 1 / theta^(2i / d), as the runtime computed it before there were types."""
    inv, scale = frequencies(RopeSpec(theta=1e6), 64)
    assert torch.equal(inv, 1.0 / (1e6 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))) and scale == 1.0


def test_the_native_layer_takes_the_scaled_tables(tmp_path):
    """In q4 the native layer runs the layers (kernels/decoder_layer.c reads the cos and sin tables
    it is given): YaRN's scaled tables give the torch layer's logits, and speculation stays exact."""
    from outrider.kernels.decoder_layer import NativeLayers

    save(tmp_path, ROPES["yarn"], intermediate=128)  # every matrix's rows a multiple of 32: all native
    model = load_decoder(tmp_path, "cpu", "q4")
    tokens = torch.randint(3, 96, (20,), generator=torch.Generator().manual_seed(2))
    cache = model.new_cache(1, 32)
    fast = model.forward(pack([0], [0], [tokens], scratch_row=cache.scratch_row), cache).logits
    assert model._native is not None and isinstance(model._native, NativeLayers)
    model._native = None  # the torch layers, the reference
    cache = model.new_cache(1, 32)
    slow = model.forward(pack([0], [0], [tokens], scratch_row=cache.scratch_row), cache).logits
    assert torch.allclose(fast, slow, atol=1e-4, rtol=1e-4)
