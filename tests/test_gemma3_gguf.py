"""A Gemma 3 GGUF read back exactly (weights/gguf_gemma3.py): a small random Gemma3ForCausalLM saved
by transformers is written as llama.cpp's converter writes a `gemma3` GGUF (its tensor names, every
norm with Gemma's 1 added, the layer pattern and the sliding layers' RoPE base in the metadata,
no query_pre_attn_scalar: head_dim's), then converted to a float32 folder and imported in place
(--dtype gguf reads the file's own tensors); both give transformers' logits. A GGUF whose norms
were not undone, or whose ffn_norm were read as Llama's, fails the same check."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from outrider.errors import ModelError
from outrider.models.batch import pack
from outrider.weights import gguf_gemma3
from outrider.weights.gguf_convert import GGUF_NAME, convert_gguf
from outrider.weights.loader import load_decoder

TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]  # pattern 3
TOKENS = torch.randint(3, 96, (24,), generator=torch.Generator().manual_seed(2))
NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
         "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
         "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "post_attention_norm",
         "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    layer, rest = hf.removeprefix("model.layers.").split(".", 1)
    return f"blk.{layer}.{NAMES[rest.removesuffix('.weight')]}.weight"


def write_gguf(model, path):
    """`model` as llama.cpp's Gemma3Model converter writes it (F32 tensors)."""
    import gguf

    c = model.config
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(c.rope_parameters["full_attention"]["rope_theta"])
    writer.add_rope_freq_base_swa(c.rope_parameters["sliding_attention"]["rope_theta"])
    writer.add_sliding_window(c.sliding_window)
    writer.add_sliding_window_pattern(3)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":  # tied
            continue
        values = tensor.float().numpy()
        if name.endswith("norm.weight"):
            values = values + np.float32(1.0)  # Gemma3RMSNorm's 1, folded by the converter
        writer.add_tensor(gguf_name(name), np.ascontiguousarray(values))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    import transformers as tf

    config = tf.Gemma3TextConfig(
        vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, sliding_window=6, layer_types=TYPES, max_position_embeddings=256,
        query_pre_attn_scalar=32, rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                         "full_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    torch.manual_seed(3)
    model = tf.Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.normal_(0, 0.5)
        want = model(TOKENS[None]).logits[0]  # [24, vocab]
    root = tmp_path_factory.mktemp("gemma3_gguf")
    write_gguf(model, root / GGUF_NAME)
    return root, want


def logits(model) -> torch.Tensor:
    cache = model.new_cache(1, 32)
    return model.forward(pack([0], [0], [TOKENS], scratch_row=cache.scratch_row), cache).logits[0]


def test_the_config_is_gemma3s(made):
    root = made[0]
    config = convert_gguf(root / GGUF_NAME, root / "meta", log=lambda line: None, tokenizer=False, weights=False)
    assert config["architectures"] == ["Gemma3ForCausalLM"] and config["layer_types"] == TYPES
    assert config["rope_parameters"]["sliding_attention"]["rope_theta"] == 100.0
    assert config["query_pre_attn_scalar"] == 32 and config["sliding_window"] == 6


@pytest.mark.parametrize("how", ["converted", "in place"])
def test_gguf_gives_transformers_logits(made, how):
    root, want = made
    folder = root / how
    convert_gguf(root / GGUF_NAME, folder, log=lambda line: None, tokenizer=False, weights=how == "converted")
    if how == "in place":
        (folder / GGUF_NAME).symlink_to(root / GGUF_NAME)
    model = load_decoder(folder, "cpu", torch.float32 if how == "converted" else "gguf")
    got = logits(model)
    assert torch.allclose(got, want, atol=2e-5, rtol=1e-4), (got - want).abs().max()


def test_the_checks_catch_norms_left_folded_and_llama_names(made, monkeypatch):
    root, want = made
    folder = root / "mutant"
    for mutant in ("norms", "names"):
        with monkeypatch.context() as m:
            if mutant == "norms":
                m.setattr(gguf_gemma3, "undo_float", lambda name, values: values)
            else:
                m.setattr(gguf_gemma3, "hf_name", lambda name: None)
            try:
                convert_gguf(root / GGUF_NAME, folder, log=lambda line: None, tokenizer=False)
                got = logits(load_decoder(folder, "cpu", torch.float32))
            except ModelError:  # names read as Llama's collide: the load refuses, which also fails the check
                continue
            assert not torch.allclose(got, want, atol=2e-5, rtol=1e-4)
    assert json.loads((folder / "config.json").read_text())["model_type"] == "gemma3_text"
