"""What each `config.json` field means to the runtime: read, inert, or a change to the arithmetic
that must be at its neutral value. A model whose config sets a field of the last kind to anything
else is refused in one line, never run wrong (a Llama 3 config with `rope_parameters:
{"rope_type": "llama3", ...}` decodes with plain RoPE otherwise, and its tokens differ from the
second on).

    refusal(raw, family) -> str | None     # why this config cannot run as written, or None

tests/test_config_fields.py checks that every field transformers' own config class writes for each
family is classified here, so a field added upstream fails the suite until someone says what it
does. Fields no class writes (a checkpoint's own extras) are not refused: a hub config carries
many; what they could change is caught again at load, where a tensor the runtime does not read is
refused (weights/loader.py). RoPE types the runtime implements (models/rope.py: default, linear,
llama3, yarn, dynamic, longrope, and a GGUF's freq_factors) are read; the others are refused.
"""

from __future__ import annotations

from typing import Callable

from .rope import TYPES as ROPE_TYPES, by_layer_type

# read by models/config.py (or a family's switch)
READ = frozenset({
    "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
    "max_position_embeddings", "tie_word_embeddings", "attention_bias",
    # Gemma 3's (models/gemma3.py): where its sliding-window layers sit when layer_types is absent
    "sliding_window_pattern", "_sliding_window_pattern",
    # Qwen2's (models/qwen2.py): where its windowed layers start when layer_types is absent (only with
    # use_sliding_window, which is checked; inert for the families that refuse a window)
    "max_window_layers",
    # a gated-delta hybrid's (models/qwen3_5.py): its layers' sizes and where attention layers sit
    "linear_conv_kernel_dim", "linear_key_head_dim", "linear_num_key_heads", "linear_num_value_heads",
    "linear_value_head_dim", "full_attention_interval",
    # a mixture of experts' (models/moe_config.py; `num_experts` itself is checked: only a family
    # with MoE MLPs reads it): the experts' sizes, the router's k and renormalisation, which layers
    "moe_intermediate_size", "shared_expert_intermediate_size", "num_experts_per_tok", "norm_topk_prob",
    "decoder_sparse_step", "mlp_only_layers",
    # latent attention's (models/mla_config.py: DeepSeek-V2 and V3, MiniCPM3; V3's rope_interleave),
    # and DeepSeek's MoE layers and router (models/deepseek_moe.py)
    "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "qk_head_dim", "v_head_dim",
    "rope_interleave",
    "first_k_dense_replace", "n_routed_experts", "n_shared_experts", "n_group", "topk_group", "topk_method",
    "routed_scaling_factor", "scoring_func", "moe_layer_freq",
})

# no effect on a forward's arithmetic at inference: names, ids, training and output switches
INERT = frozenset({
    "_name_or_path", "transformers_version", "dtype", "torch_dtype", "bos_token_id", "eos_token_id",
    "pad_token_id", "use_cache", "output_attentions", "output_hidden_states", "return_dict", "id2label",
    "label2id", "problem_type", "chunk_size_feed_forward", "is_encoder_decoder", "initializer_range",
    "attention_dropout", "pretraining_tp", "auto_map", "tokenizer_class",
    "use_return_dict", "tf_legacy_loss", "pruned_heads", "torchscript", "add_cross_attention",
    "output_router_logits", "router_aux_loss_coef",  # an MoE's training loss
    "router_jitter_noise",  # Mixtral's router noise, in training only
    "aux_loss_alpha", "seq_aux",  # DeepSeek's own configs' name for it
    # DeepSeek-V3's multi-token-prediction module: not in the forward (its tensors are refused at load)
    "num_nextn_predict_layers",
})


def _rope_type(value) -> str:
    if not value:
        return "default"
    per_type = by_layer_type(value)  # Gemma 3's rope_parameters, one table a layer type: the first not run
    if per_type:
        kinds = [_rope_type(v) for v in per_type.values()]
        return next((k for k in kinds if k not in ROPE_TYPES), kinds[0])
    return str(value.get("rope_type", value.get("type", "default")) or "default")


def _sliding(raw: dict) -> bool:
    """Whether some layer attends within a window shorter than the model's context."""
    types = raw.get("layer_types")
    if types and any(t != "full_attention" for t in types):
        return True
    window = raw.get("sliding_window")
    if window is None or not raw.get("use_sliding_window", True):
        return False
    return int(window) < int(raw.get("max_position_embeddings", 1 << 30))


# field -> (neutral?, what it is): set otherwise, the config is refused
CHECKED: dict[str, tuple[Callable[[object, dict], bool], str]] = {
    "rope_scaling": (lambda v, raw: _rope_type(v) in ROPE_TYPES, "RoPE scaling"),
    "rope_parameters": (lambda v, raw: _rope_type(v) in ROPE_TYPES, "RoPE scaling"),
    "sliding_window": (lambda v, raw: not _sliding(raw), "sliding-window attention"),
    "use_sliding_window": (lambda v, raw: not _sliding(raw), "sliding-window attention"),
    "layer_types": (lambda v, raw: not _sliding(raw), "sliding-window attention"),
    "partial_rotary_factor": (lambda v, raw: partial_rotary(raw) == 1.0, "partial rotary embeddings"),
    "final_logit_softcapping": (lambda v, raw: v is None, "logit soft-capping"),
    "attn_logit_softcapping": (lambda v, raw: v is None, "attention logit soft-capping"),
    "attention_sink": (lambda v, raw: not v, "attention sinks"),
    "hidden_act": (lambda v, raw: v in ("silu", "swish"), "an MLP activation other than SiLU"),
    "mlp_bias": (lambda v, raw: not v, "biases on the MLP projections"),
    "quantization_config": (lambda v, raw: not v, "pre-quantized weights (GPTQ, AWQ, ...)"),
    "num_experts": (lambda v, raw: not v, "a mixture of experts"),
    "num_local_experts": (lambda v, raw: not v, "a mixture of experts"),  # Mixtral's name, Qwen3MoeConfig's
    "clip_qkv": (lambda v, raw: v is None, "q, k and v clipped"),  # OLMoE's (OLMo's) clamp
    # Gemma 3's (models/gemma3.py reads them)
    "hidden_activation": (lambda v, raw: v in ("silu", "swish"), "an MLP activation other than SiLU"),
    "query_pre_attn_scalar": (lambda v, raw: v is None, "an attention scale other than 1 / sqrt(head_dim)"),
    "rope_local_base_freq": (lambda v, raw: v is None, "a RoPE base of its own on sliding-window layers"),
    "use_bidirectional_attention": (lambda v, raw: not v, "bidirectional attention"),
    # MiniCPM3's scalings (models/minicpm3.py reads them)
    "scale_emb": (lambda v, raw: v in (None, 1), "scaled embeddings"),
    "scale_depth": (lambda v, raw: v is None, "scaled residual branches"),
    "dim_model_base": (lambda v, raw: v is None or int(v) == int(raw.get("hidden_size", 0)), "scaled logits"),
}


def partial_rotary(raw: dict) -> float:
    """The share of each head's dimensions that rotate (transformers 5 keeps it in rope_parameters)."""
    factor = raw.get("partial_rotary_factor", (raw.get("rope_parameters") or {}).get("partial_rotary_factor"))
    return 1.0 if factor is None else float(factor)


def refusal(raw: dict, family) -> str | None:
    """Why `raw` (a config.json dict of `family`) cannot run as written, or None. A family reads
    some checked fields itself (`Family.reads`: a hybrid's layer_types, its partial rotary)."""
    for name, (neutral, what) in CHECKED.items():
        if name in raw and name not in family.reads and not neutral(raw[name], raw):
            shown = raw[name] if not isinstance(raw[name], (dict, list)) else _short(raw[name])
            return f"{what} ({name}: {shown}) is not supported yet for {family.name}"
    if "partial_rotary_factor" not in family.reads and partial_rotary(raw) != 1.0:  # where transformers 5 keeps it
        return f"partial rotary embeddings (partial_rotary_factor: {partial_rotary(raw)}) is not supported yet for {family.name}"
    if "rope_parameters" in family.reads and _rope_type(raw.get("rope_parameters")) not in ROPE_TYPES:
        return f"RoPE scaling (rope_parameters: {_short(raw['rope_parameters'])}) is not supported yet for {family.name}"
    if raw.get("attention_bias") and family.name != "qwen2":
        return f"attention_bias: true (a bias on o_proj as well as Q, K, V) is not supported yet for {family.name}"
    return None


def _short(value) -> str:
    if isinstance(value, dict):
        kind = _rope_type(value)
        return f"rope_type {kind!r}" if kind != "default" else "{...}"
    kinds = sorted(set(map(str, value)))
    return f"[{', '.join(kinds)}]"
