"""A Qwen3-MoE, OLMoE or Mixtral folder saved by transformers, written as a GGUF in llama.cpp's
converter's layout.

    write_moe_gguf(hf_folder, "tiny.gguf", "Q8_0")   # arch qwen3moe / olmoe / llama (Mixtral)

Our own code, following what llama.cpp's convert_hf_to_gguf.py does to these checkpoints
(conversion/qwen.py Qwen3MoeModel over Qwen2MoeModel, conversion/olmo.py OlmoeModel,
conversion/llama.py LlamaModel for MixtralForCausalLM; base.py's metadata and choice of tensor
types), as llama-cpp-python 0.3.36's vendored copy has it:
- names from gguf-py's tensor map: attn_norm, ffn_norm, attn_q / k / v / output, attn_q_norm /
  attn_k_norm, the router (`mlp.gate`, Mixtral's `block_sparse_moe.gate`) as ffn_gate_inp, a dense
  layer's ffn_gate / ffn_up / ffn_down;
- each layer's experts stacked [experts, out, in] as ffn_gate_exps, ffn_up_exps, ffn_down_exps
  (Mixtral's w1, w3, w2);
- Mixtral (a llama): Q and K rows permuted to interleaved pairs; rope.dimension_count and
  vocab_size written;
- metadata: expert_count, expert_used_count, Qwen3-MoE's expert_feed_forward_length, key_length /
  value_length where the config has head_dim; OLMoE's rms epsilon written as 1e-5 (OlmoeModel);
- types: 1-D tensors, norms and the router (FFN_GATE_INP) in F32, the rest in the asked type.
The tokenizer is test_gguf_import's byte-level BPE (a vocabulary of 264).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

RENAMES = [("model.embed_tokens.weight", "token_embd.weight"), ("model.norm.weight", "output_norm.weight"),
           ("lm_head.weight", "output.weight"), ("model.layers.", "blk."), ("input_layernorm", "attn_norm"),
           ("post_attention_layernorm", "ffn_norm"), ("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"),
           ("self_attn.v_proj", "attn_v"), ("self_attn.o_proj", "attn_output"), ("self_attn.q_norm", "attn_q_norm"),
           ("self_attn.k_norm", "attn_k_norm"), ("block_sparse_moe.gate.", "ffn_gate_inp."),
           ("mlp.gate.", "ffn_gate_inp."), ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"),
           ("mlp.down_proj", "ffn_down"), ("experts.gate_proj", "ffn_gate_exps"), ("experts.up_proj", "ffn_up_exps"),
           ("experts.down_proj", "ffn_down_exps")]
STACKED = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj",
           "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}  # an expert's tensor -> its stack
ARCH = {"qwen3_moe": "qwen3moe", "olmoe": "olmoe", "mixtral": "llama"}


def _permute(rows: np.ndarray, heads: int) -> np.ndarray:
    d = rows.shape[0] // heads
    return rows.reshape(heads, 2, d // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _stacked(arrays: dict, experts: int) -> dict:
    """Per-expert tensors -> `model.layers.N.experts.<gate_proj|up_proj|down_proj>.weight` [experts, out, in]."""
    out, seen = {}, set()
    for name in sorted(arrays):
        if ".experts." not in name:
            out[name] = arrays[name]
            continue
        base, rest = name.split(".experts.")
        part = rest.split(".")[1]
        if (base, part) in seen:
            continue
        seen.add((base, part))
        layer = base.split(".mlp")[0].split(".block_sparse_moe")[0]
        out[f"{layer}.experts.{STACKED[part]}.weight"] = np.stack(
            [arrays[f"{base}.experts.{j}.{part}.weight"] for j in range(experts)])
    return out


def write_moe_gguf(folder: Path, path: Path, qtype: str = "F32", tokenizer: bool = True) -> None:
    """Write `folder` (a Qwen3-MoE, OLMoE or Mixtral saved by transformers) to `path` as the
    converter would (--outtype f32 / q8_0 for F32 / Q8_0); tokenizer=False: no tokenizer fields
    (scripts/check_moe_gguf_layout.py compares the model's tensors and metadata only)."""
    import gguf
    import torch
    from safetensors.torch import load_file

    import test_gguf_import as bpe

    c = json.loads((Path(folder) / "config.json").read_text())
    arch = ARCH[c["model_type"]]
    heads, kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
    experts = c.get("num_local_experts") or c["num_experts"]
    tensors = load_file(str(next(Path(folder).glob("*.safetensors"))))
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(c["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(1e-5 if arch == "olmoe" else c["rms_norm_eps"])
    w.add_expert_count(experts)
    w.add_expert_used_count(c["num_experts_per_tok"])
    if c.get("head_dim") is not None:
        w.add_key_length(c["head_dim"])
        w.add_value_length(c["head_dim"])
    w.add_file_type({"F32": 0, "Q8_0": 7}.get(qtype, 0))
    if arch == "qwen3moe":
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    if arch == "llama":
        w.add_vocab_size(c["vocab_size"])
        w.add_rope_dimension_count(c.get("head_dim") or c["hidden_size"] // heads)
    w.add_quantization_version(2)
    if tokenizer:
        _add_tokenizer(w, c, bpe)
    arrays = _stacked({k: v.to(torch.float32).numpy() for k, v in tensors.items()}, experts)
    for name in sorted(arrays):
        x = arrays[name]
        if arch == "llama" and ".self_attn.q_proj." in name:
            x = _permute(x, heads)
        elif arch == "llama" and ".self_attn.k_proj." in name:
            x = _permute(x, kv_heads)
        add_tensor(w, renamed(name, RENAMES), x, qtype)
    finish(w)


def renamed(name: str, renames) -> str:
    """A Hugging Face name under gguf-py's, by the (old, new) pairs in order."""
    for old, new in renames:
        name = name.replace(old, new)
    return name


def add_tensor(w, gname: str, x: np.ndarray, qtype: str) -> None:
    """x as the converter types it: 1-D tensors, norms and the router F32, the rest in qtype."""
    import gguf

    if qtype == "F32" or x.ndim <= 1 or gname.endswith("_norm.weight") or ".ffn_gate_inp." in gname:
        w.add_tensor(gname, x.astype(np.float32))
    else:
        kind = gguf.GGMLQuantizationType[qtype]
        data = gguf.quants.quantize(x, kind)
        w.add_tensor(gname, data, raw_shape=data.shape, raw_dtype=kind)


def finish(w) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _add_tokenizer(w, c: dict, bpe) -> None:
    tokens = bpe._tokenizer_vocab()
    assert len(tokens) == c["vocab_size"], "the model's vocab_size must be the BPE's 264"
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(bpe.SPECIALS) + [1] * (len(tokens) - len(bpe.SPECIALS)))
    w.add_token_merges(bpe.MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(bpe.CHATML)
