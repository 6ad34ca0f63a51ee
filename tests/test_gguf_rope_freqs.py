"""A Llama 3 GGUF's RoPE scaling (weights/gguf_convert.py, models/rope.py `freq_factors`): a small
random Llama with llama3 scaling (original context 64) saved by transformers is written as llama.cpp's
converter writes it (a `llama` GGUF: Q/K rows permuted, no rope.scaling fields, the scaling as a
`rope_freqs` tensor of per-pair divisors computed the converter's way), then converted to a float32
folder and imported in place; over 100 tokens (past the original context) both give the logits of
the safetensors folder's load and of transformers. With the factors ignored (plain RoPE), the same
check fails."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from outrider.models.batch import pack
from outrider.weights.gguf_convert import GGUF_NAME, convert_gguf
from outrider.weights.loader import load_decoder

ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64, "rope_theta": 10000.0}
TOKENS = torch.randint(3, 96, (100,), generator=torch.Generator().manual_seed(5))
NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
         "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    layer, rest = hf.removeprefix("model.layers.").split(".", 1)
    return f"blk.{layer}.{NAMES[rest.removesuffix('.weight')]}.weight"


def permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's Q/K row order: each head's two halves interleaved in pairs."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def rope_factors(dim: int) -> list[float]:
    """The converter's rope_freqs for ROPE (its generate_extra_tensors, rewritten)."""
    original, low, high, factor = 64, 1.0, 4.0, 8.0
    out = []
    for i in range(0, dim, 2):
        wavelength = 2 * math.pi * ROPE["rope_theta"] ** (i / dim)
        if wavelength < original / high:
            out.append(1.0)
        elif wavelength > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def write_gguf(model, path):
    import gguf

    c = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_dimension_count(c.head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(ROPE["rope_theta"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_tensor("rope_freqs.weight", np.array(rope_factors(c.head_dim), dtype=np.float32))
    for name, tensor in model.state_dict().items():
        values = tensor.float().numpy()
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            values = permute(values, c.num_attention_heads if "q_proj" in name else c.num_key_value_heads)
        writer.add_tensor(gguf_name(name), np.ascontiguousarray(values))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def logits(model) -> torch.Tensor:
    cache = model.new_cache(1, 128)
    return model.forward(pack([0], [0], [TOKENS], scratch_row=cache.scratch_row), cache).logits[0]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    import transformers as tf

    config = tf.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                            tie_word_embeddings=False, rope_parameters=ROPE)
    torch.manual_seed(6)
    model = tf.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0 if p.dim() > 1 else 1.0)
        want = model(TOKENS[None]).logits[0]  # [100, vocab]
    root = tmp_path_factory.mktemp("llama3_gguf")
    model.save_pretrained(root / "safetensors")
    write_gguf(model, root / GGUF_NAME)
    return root, want, logits(load_decoder(root / "safetensors", "cpu", torch.float32))


def close(got, want) -> bool:
    return torch.allclose(got, want, atol=5e-5, rtol=1e-4)


def test_the_config_keeps_the_factors(made):
    root = made[0]
    config = convert_gguf(root / GGUF_NAME, root / "meta", log=lambda line: None, tokenizer=False, weights=False)
    rope = config["rope_parameters"]
    assert rope["rope_type"] == "freq_factors" and rope["freq_factors"] == pytest.approx(rope_factors(16))
    assert len(set(rope["freq_factors"])) == 4  # kept, two blended, divided: every branch of the scaling


@pytest.mark.parametrize("how", ["converted", "in place"])
def test_gguf_gives_the_safetensors_logits(made, how):
    root, want, safetensors = made
    folder = root / how
    convert_gguf(root / GGUF_NAME, folder, log=lambda line: None, tokenizer=False, weights=how == "converted")
    if how == "in place":
        (folder / GGUF_NAME).symlink_to(root / GGUF_NAME)
    got = logits(load_decoder(folder, "cpu", torch.float32 if how == "converted" else "gguf"))
    assert close(safetensors, want), (safetensors - want).abs().max()
    assert close(got, safetensors), (got - safetensors).abs().max()


def test_ignoring_the_factors_fails(made):
    root, want, safetensors = made
    folder = root / "ignored"
    convert_gguf(root / GGUF_NAME, folder, log=lambda line: None, tokenizer=False)
    raw = json.loads((folder / "config.json").read_text())
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": ROPE["rope_theta"]}
    (folder / "config.json").write_text(json.dumps(raw))
    got = logits(load_decoder(folder, "cpu", torch.float32))
    assert close(got[:1], safetensors[:1])  # position 0 turns nothing: only the RoPE differs
    assert not close(got, safetensors)
