"""A DeepSeek-V2 or V3 folder saved by transformers, written as a `deepseek2` GGUF in llama.cpp's
converter's layout.

    write_deepseek_gguf(hf_folder, "tiny.gguf", "Q8_0", split_kv_b=True)

Our own code, following what llama.cpp's convert_hf_to_gguf.py does to these checkpoints
(conversion/deepseek.py DeepseekV2Model over base.py's TextModel), as llama-cpp-python 0.3.36's
vendored copy has it:
- names from gguf-py's tensor map: attn_q or attn_q_a / attn_q_a_norm / attn_q_b, attn_kv_a_mqa,
  attn_kv_a_norm, attn_output, attn_norm, ffn_norm, the router ffn_gate_inp, V3's
  e_score_correction_bias as exp_probs_b.bias, shared experts ffn_*_shexp, a dense layer's
  ffn_gate / ffn_up / ffn_down, the routed experts stacked [experts, out, in] as ffn_*_exps;
  no row permutation (deepseek2's RoPE is llama.cpp's interleaved kind, as DeepSeek's);
- kv_b_proj: split_kv_b (the current converter) as attn_k_b [H, r, dn] (each head's key block
  transposed) and attn_v_b [H, dv, r], with key_length r + dr, value_length r, head_count_kv 1 and
  key_length_mla / value_length_mla the heads' own sizes; otherwise (a legacy file) attn_kv_b whole
  with key_length dn + dr, value_length dv and head_count_kv H;
- metadata: leading_dense_block_count, q_lora_rank (where the config has one), kv_lora_rank,
  expert_feed_forward_length, expert_count, expert_used_count, expert_shared_count,
  expert_weights_scale (routed_scaling_factor), expert_weights_norm where norm_topk_prob is true,
  expert_group_count / expert_group_used_count where n_group / topk_group are set,
  expert_gating_func where the config names a scoring function (V3's config class does not: like
  the converter, V3 gets `sigmoid` only through `scoring_func`, which the caller passes);
- types: 1-D tensors, norms and the router in F32, the rest in the asked type.
The tokenizer is test_gguf_import's byte-level BPE (a vocabulary of 264).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

RENAMES = [("model.embed_tokens.weight", "token_embd.weight"), ("model.norm.weight", "output_norm.weight"),
           ("lm_head.weight", "output.weight"), ("model.layers.", "blk."), ("input_layernorm", "attn_norm"),
           ("post_attention_layernorm", "ffn_norm"), ("self_attn.q_a_layernorm", "attn_q_a_norm"),
           ("self_attn.q_a_proj", "attn_q_a"), ("self_attn.q_b_proj", "attn_q_b"), ("self_attn.q_proj", "attn_q"),
           ("self_attn.kv_a_proj_with_mqa", "attn_kv_a_mqa"), ("self_attn.kv_a_layernorm", "attn_kv_a_norm"),
           ("self_attn.kv_b_proj", "attn_kv_b"), ("self_attn.k_b_proj", "attn_k_b"), ("self_attn.v_b_proj", "attn_v_b"),
           ("self_attn.o_proj", "attn_output"), ("mlp.gate.e_score_correction_bias", "exp_probs_b.bias"),
           ("mlp.gate.", "ffn_gate_inp."), ("mlp.shared_experts.gate_proj", "ffn_gate_shexp"),
           ("mlp.shared_experts.up_proj", "ffn_up_shexp"), ("mlp.shared_experts.down_proj", "ffn_down_shexp"),
           ("experts.gate_proj", "ffn_gate_exps"), ("experts.up_proj", "ffn_up_exps"),  # moe_gguf._stacked's
           ("experts.down_proj", "ffn_down_exps"), ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"),
           ("mlp.down_proj", "ffn_down")]


def _split_kv_b(arrays: dict, heads: int, nope: int, v: int) -> dict:
    """Each kv_b_proj [H (dn + dv), r] -> k_b_proj [H, r, dn] and v_b_proj [H, dv, r] (the converter's)."""
    out = {}
    for name, x in arrays.items():
        if not name.endswith("kv_b_proj.weight"):
            out[name] = x
            continue
        kv_b = x.reshape(heads, nope + v, x.shape[-1])
        out[name.replace("kv_b_proj", "k_b_proj")] = np.ascontiguousarray(kv_b[:, :nope].transpose(0, 2, 1))
        out[name.replace("kv_b_proj", "v_b_proj")] = np.ascontiguousarray(kv_b[:, nope:])
    return out


def write_deepseek_gguf(folder: Path, path: Path, qtype: str = "F32", split_kv_b: bool = True,
                        scoring_func: str | None = None, tokenizer: bool = True) -> None:
    """Write `folder` (DeepSeek-V2 or V3 saved by transformers) to `path` as the converter would
    (--outtype f32 / q8_0 for F32 / Q8_0). scoring_func: what the checkpoint's config.json names
    (DeepSeek's own V3 configs say "sigmoid"; transformers' config class writes none; None: the
    config's own `scoring_func`, if any); tokenizer=False: no tokenizer fields
    (scripts/check_moe_gguf_layout.py compares the model's tensors and metadata only)."""
    import gguf
    import torch
    from safetensors.torch import load_file

    import test_gguf_import as bpe
    from moe_gguf import _add_tokenizer, _stacked, add_tensor, finish, renamed

    c = json.loads((Path(folder) / "config.json").read_text())
    scoring_func = scoring_func or c.get("scoring_func")
    heads, rope, r = c["num_attention_heads"], c["qk_rope_head_dim"], c["kv_lora_rank"]
    nope, v = c["qk_nope_head_dim"], c["v_head_dim"]
    w = gguf.GGUFWriter(str(path), "deepseek2")
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(1 if split_kv_b else heads)
    w.add_rope_freq_base(c["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_expert_count(c["n_routed_experts"])
    w.add_expert_used_count(c["num_experts_per_tok"])
    if c.get("n_group") is not None:
        w.add_expert_group_count(c["n_group"])
    if c.get("topk_group") is not None:
        w.add_expert_group_used_count(c["topk_group"])
    if scoring_func is not None:
        w.add_expert_gating_func({"sigmoid": gguf.ExpertGatingFuncType.SIGMOID,
                                  "softmax": gguf.ExpertGatingFuncType.SOFTMAX}[scoring_func])
    w.add_file_type({"F32": 0, "Q8_0": 7}.get(qtype, 0))
    w.add_leading_dense_block_count(c["first_k_dense_replace"])
    w.add_vocab_size(c["vocab_size"])
    if c.get("q_lora_rank") is not None:
        w.add_q_lora_rank(c["q_lora_rank"])
    w.add_kv_lora_rank(r)
    if split_kv_b:
        w.add_key_length(r + rope)
        w.add_value_length(r)
        w.add_key_length_mla(nope + rope)
        w.add_value_length_mla(v)
    else:
        w.add_key_length(nope + rope)
        w.add_value_length(v)
    w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    w.add_expert_shared_count(c["n_shared_experts"])
    w.add_expert_weights_scale(c["routed_scaling_factor"])
    if c.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(rope)
    w.add_quantization_version(2)
    if tokenizer:
        _add_tokenizer(w, c, bpe)
    saved = load_file(str(Path(folder) / "model.safetensors"))
    arrays = _stacked({k: t.to(torch.float32).numpy() for k, t in saved.items()}, c["n_routed_experts"])
    if split_kv_b:
        arrays = _split_kv_b(arrays, heads, nope, v)
    for name in sorted(arrays):
        add_tensor(w, renamed(name, RENAMES), arrays[name], qtype)
    finish(w)
