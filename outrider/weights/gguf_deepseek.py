"""DeepSeek-V2 / V3 GGUFs (llama.cpp architecture `deepseek2`: latent attention, shared and routed
experts) read in place under Hugging Face's names.

    config(meta, shapes)        the config.json of a deepseek2 GGUF (DeepseekV2 or V3ForCausalLM)
    tensors(index, name_of)     its tensors under the names weights/latent_load.py and mlp_load.py read

What llama.cpp's converter writes (convert_hf_to_gguf.py, conversion/deepseek.py DeepseekV2Model,
base.py's metadata; read in llama-cpp-python 0.3.36's vendored copy, with src/models/deepseek2.cpp,
the graph that runs it), and how it is read back here:

- names: q_proj -> attn_q, or q_a_proj / q_a_layernorm / q_b_proj -> attn_q_a / attn_q_a_norm /
  attn_q_b; kv_a_proj_with_mqa -> attn_kv_a_mqa, kv_a_layernorm -> attn_kv_a_norm, o_proj ->
  attn_output; the router mlp.gate -> ffn_gate_inp (F32), V3's e_score_correction_bias ->
  exp_probs_b.bias (F32); shared_experts.* -> ffn_*_shexp; the routed experts stacked [experts,
  out, in] as ffn_gate_exps / ffn_up_exps / ffn_down_exps (read one tensor an expert, as
  gguf_moe.py does); the dense first layers' ffn_gate / ffn_up / ffn_down. Rows are NOT permuted:
  llama.cpp turns deepseek2's RoPE on interleaved pairs (LLAMA_ROPE_TYPE_NORM), as DeepSeek does,
  so the loader's own reordering (latent_load.py) applies as to a safetensors checkpoint.
- kv_b_proj [H (dn + dv), r], in either of two forms the sources show: legacy files keep it whole as
  attn_kv_b (and say key_length dn + dr, value_length dv, head_count_kv H); current ones split it
  for the absorbed form, attn_k_b [H, r, dn] (each head's key block transposed) and attn_v_b
  [H, dv, r], and say key_length_mla dn + dr, value_length_mla dv (key_length r + dr,
  value_length r, head_count_kv 1: the MQA view). Both are read back as the one kv_b_proj
  (`JoinedKvB`: dequantized and interleaved head by head when read; kv_b is read as float
  whatever the load's quantization, latent_load.py).
- the router: `expert_gating_func` 2 (sigmoid) is V3 (noaux_tc: groups scored by their best two
  experts, which is llama.cpp's group rule too), 1 or absent (llama.cpp's default for V2 files) is V2
  (softmax; `greedy`, or `group_limited_greedy` where expert_group_count > 1); expert_weights_norm
  -> norm_topk_prob, expert_weights_scale -> routed_scaling_factor, expert_shared_count ->
  n_shared_experts, leading_dense_block_count -> first_k_dense_replace,
  expert_group_count / expert_group_used_count -> n_group / topk_group.

Where llama.cpp and transformers differ, this reads the file as transformers runs its checkpoint
(the model's definition): V2's group_limited_greedy scores a group by its best expert (llama.cpp's
graph by its best two); the latent and q LoRA norms use eps 1e-6 (llama.cpp: the file's
rms epsilon; the same for DeepSeek's own 1e-6). Refused in one line: YaRN RoPE (the GGUF keeps
mscale_all_dim as a log multiplier, not mscale: not enough to rebuild transformers' YaRN), another
gating function, attn_k_b without attn_v_b, and shapes that disagree with the metadata.
"""

from __future__ import annotations

import re

import numpy as np

from ..errors import ModelError
from .gguf_hybrid import EXPERTS  # the stacked experts' names: ffn_gate_exps -> gate_proj ...

ARCH = "deepseek2"
MODELS = {2: ("deepseek_v2", "DeepseekV2ForCausalLM"), 3: ("deepseek_v3", "DeepseekV3ForCausalLM")}
GATING = {1: 2, 2: 3}  # gguf ExpertGatingFuncType (softmax, sigmoid) -> DeepSeek version
LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
}
SPLIT = ("attn_k_b.weight", "attn_v_b.weight")  # the current converter's kv_b_proj, in two
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def hf_name(gguf_name: str) -> str | None:
    """`blk.3.attn_kv_a_mqa.weight` -> `model.layers.3.self_attn.kv_a_proj_with_mqa.weight`; None
    for a name not of this layout (the global ones: gguf_convert.hf_tensor_name)."""
    match = _BLOCK.fullmatch(gguf_name)
    if match and match.group(2) in LAYER_TENSORS:
        return f"model.layers.{match.group(1)}.{LAYER_TENSORS[match.group(2)]}"
    return None


class JoinedKvB:
    """kv_b_proj [H (dn + dv), r] float32 from attn_k_b [H, r, dn] and attn_v_b [H, dv, r] (either
    kind, dequantized when `data` is read): head h's rows are k_b[h] transposed, then v_b[h]. Read
    like a gguf_index.IndexedTensor of type F32."""

    type = "F32"

    def __init__(self, name: str, k_b, v_b):
        heads, rank, nope = k_b.shape
        if len(v_b.shape) != 3 or v_b.shape[0] != heads or v_b.shape[2] != rank:
            raise ModelError(f"GGUF {k_b.name} is {list(k_b.shape)} and {v_b.name} {list(v_b.shape)}: not [H, r, dn] "
                             "and [H, dv, r] of one H and r")
        self.name, self.k_b, self.v_b = name, k_b, v_b
        self.shape = (heads * (nope + v_b.shape[1]), rank)

    @property
    def data(self) -> np.ndarray:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        k, v = (np.asarray(dequantize(t.data, GGMLQuantizationType[t.type]), dtype=np.float32).reshape(t.shape)
                for t in (self.k_b, self.v_b))  # [H, r, dn], [H, dv, r]
        return np.concatenate((k.transpose(0, 2, 1), v), axis=1).reshape(self.shape)  # [H, dn + dv, r] -> rows


def tensors(index, name_of) -> dict:
    """A deepseek2 GGUF's tensors (gguf_index.IndexedTensor) under Hugging Face names: the stacked
    experts one tensor an expert, attn_k_b + attn_v_b as one kv_b_proj, a multi-token-prediction
    block past block_count as mtp.* (not read, as for a safetensors checkpoint), the rest by
    LAYER_TENSORS or `name_of` (hf_tensor_name)."""
    from .gguf_moe import one_an_expert

    layers = int(index.meta[f"{ARCH}.block_count"])
    out, split = {}, {}
    for name, t in index.tensors.items():
        match = _BLOCK.fullmatch(name)
        if match and int(match.group(1)) >= layers:
            out[f"mtp.{name}"] = t
        elif match and match.group(2) in EXPERTS:
            out.update(one_an_expert(t, int(match.group(1)), EXPERTS[match.group(2)]))
        elif match and match.group(2) in SPLIT:
            split.setdefault(int(match.group(1)), {})[match.group(2)] = t
        elif match:
            out[hf_name(name) or name_of(name)] = t
        else:
            out[name_of(name)] = t
    for layer, parts in split.items():
        if len(parts) != 2:
            raise ModelError(f"GGUF layer {layer} keeps {next(iter(parts))} without its other half "
                             f"({' and '.join(SPLIT)} are kv_b_proj split in two); the file is incomplete")
        name = f"model.layers.{layer}.self_attn.kv_b_proj.weight"
        out[name] = JoinedKvB(name, parts[SPLIT[0]], parts[SPLIT[1]])
    return out


def config(meta: dict, shapes: dict[str, tuple[int, ...]], common: dict) -> dict:
    """The config.json of a deepseek2 GGUF (shapes: gguf name -> Hugging Face shape; common: the
    activation, RMS epsilon, RoPE, context, token ids and inert fields every converted config has,
    gguf_convert.common_fields)."""
    key = lambda name, default=None: meta.get(f"{ARCH}.{name}", default)  # noqa: E731
    scaling = key("rope.scaling.type")
    if scaling not in (None, "none"):
        raise ModelError(f"GGUF deepseek2 rope scaling '{scaling}' is not supported: the file keeps YaRN's "
                         "mscale_all_dim as a log multiplier and not its mscale; use the safetensors checkpoint")
    gating = int(key("expert_gating_func") or 1)  # absent: softmax (llama.cpp's default for V2 files)
    if gating not in GATING:
        raise ModelError(f"GGUF deepseek2 expert_gating_func {gating} is not supported (1 softmax: V2, 2 sigmoid: V3)")
    version = GATING[gating]
    hidden, heads, layers = int(key("embedding_length")), int(key("attention.head_count")), int(key("block_count"))
    rope, kv_rank = int(key("rope.dimension_count")), int(key("attention.kv_lora_rank"))
    split = any(n.endswith(".attn_k_b.weight") for n in shapes)
    if key("attention.key_length_mla") is not None:  # the current converter's (the MQA view in key_length)
        qk, v = int(key("attention.key_length_mla")), int(key("attention.value_length_mla"))
    elif split:
        raise ModelError("GGUF deepseek2 keeps attn_k_b / attn_v_b but no key_length_mla; the file is not supported")
    else:  # a legacy file: attn_kv_b whole, the heads' own sizes in key_length / value_length
        qk, v = int(key("attention.key_length")), int(key("attention.value_length"))
    q_rank = int(key("attention.q_lora_rank") or 0)
    kv_a = shapes.get("blk.0.attn_kv_a_mqa.weight", (None,))[0]
    q = shapes.get("blk.0.attn_q_b.weight" if q_rank else "blk.0.attn_q.weight", (None,))[0]
    if kv_a != kv_rank + rope or q != heads * qk or qk <= rope:
        raise ModelError(f"GGUF shapes disagree with its metadata (kv_a_mqa rows {kv_a}, q rows {q}; kv_lora_rank "
                         f"{kv_rank}, {heads} heads of {qk} with {rope} rotated); this file is not supported")
    experts = int(key("expert_count") or 0)
    groups = int(key("expert_group_count") or 1)
    grouped = groups > 1
    scale = key("expert_weights_scale")
    out = {
        "architectures": [MODELS[version][1]],
        "model_type": MODELS[version][0],
        "vocab_size": shapes["token_embd.weight"][0],
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "q_lora_rank": q_rank or None,
        "kv_lora_rank": kv_rank,
        "qk_nope_head_dim": qk - rope,
        "qk_rope_head_dim": rope,
        "v_head_dim": v,
        "tie_word_embeddings": "output.weight" not in shapes,
        "attention_bias": False,
        **common,
        "first_k_dense_replace": int(key("leading_dense_block_count", 0)) if experts else layers,
        "n_routed_experts": experts or None,
        "n_shared_experts": int(key("expert_shared_count", 0)),
        "num_experts_per_tok": int(key("expert_used_count", 0)) or None,
        "moe_intermediate_size": int(key("expert_feed_forward_length", 0)) or None,
        "routed_scaling_factor": 1.0 if scale in (None, 0) else _decimal(scale),
        "norm_topk_prob": bool(key("expert_weights_norm", False)),
        "topk_method": "noaux_tc" if version == 3 else "group_limited_greedy" if grouped else "greedy",
        "n_group": groups if grouped or version == 3 else None,
        "topk_group": int(key("expert_group_used_count") or 1) if grouped or version == 3 else None,
    }
    if version == 3:
        out["rope_interleave"] = True  # llama.cpp turns interleaved pairs whatever the checkpoint said
    return out


def _decimal(value: float) -> float:
    """The shortest decimal that rounds to the same float32 (the file stores 1e-6 as 9.99999997e-07)."""
    return float(str(np.float32(value)))
