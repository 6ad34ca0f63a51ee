"""A Qwen3.5 (or Qwen3-Next) folder saved by transformers, written as a GGUF in llama.cpp's
converter's layout.

    write_qwen35_gguf(hf_folder, "tiny.gguf", "Q8_0")   # arch qwen35 (qwen3next), the converter's names and transforms

Our own code, following what llama.cpp's convert_hf_to_gguf.py does to a Qwen3.5 checkpoint
(conversion/qwen.py: Qwen3_5TextModel, _LinearAttentionVReorderBase, Qwen3NextModel; base.py's
choice of tensor types), as llama-cpp-python 0.3.36's vendored copy has it:
- value heads reordered from grouped by key head to tiled (when there are more value heads than
  key heads) in in_proj_qkv's V rows, in_proj_z, in_proj_a, in_proj_b, A_log, dt_bias, conv1d's V
  channels and out_proj's columns;
- A_log stored as -exp(A_log) (`ssm_a`), dt_bias as `ssm_dt.bias`, conv1d squeezed to [C, K];
- every `*norm.weight` but linear_attn.norm stored as 1 + w;
- types: 1-D tensors, norms, ssm_conv1d and names not ending in .weight in F32; the rest in the
  asked type, or F16 where a row does not split into its blocks (as base.py falls back);
- a multi-token-prediction head (`mtp.*` tensors, kept unless --no-mtp: _QwenMtpMixin) as block L
  after the model's L layers: mtp.layers.0.* as that block's layer, mtp.fc / pre_fc_norm_embedding
  / pre_fc_norm_hidden / norm as nextn.eh_proj / enorm / hnorm / shared_head_norm (norms + 1),
  with nextn_predict_layers and a False appended to recurrent_layers.
Qwen3-Next (Qwen3NextModel, Qwen2MoeModel), arch qwen3next: the same, less the value-head reorder,
plus in_proj_qkvz split per key head into attn_qkv (all q, all k, all v) and attn_gate (z),
in_proj_ba kept as ssm_ba, the experts stacked into ffn_{gate,up,down}_exps [experts, out, in],
the router ffn_gate_inp and shared expert gate ffn_gate_inp_shexp in F32, the shared expert as
ffn_*_shexp, and the expert sizes in the metadata (no rope.dimension_sections).
The converter's tokenizer step needs a tokenizer it knows (it refuses a tiny word-level one), so
the tokenizer here is test_gguf_import's small byte-level BPE (vocabulary of 264).

scripts/check_qwen35_gguf_layout.py checks this writer against the real converter's output for
the same folder (every tensor's name, type, shape and bytes, and the model metadata equal);
its run is recorded in docs/models.md.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

RENAMES = [  # Hugging Face -> gguf, in this order (the converter's tensor map for MODEL_ARCH.QWEN35)
    ("model.embed_tokens.weight", "token_embd.weight"), ("model.norm.weight", "output_norm.weight"),
    ("lm_head.weight", "output.weight"), ("model.layers.", "blk."),
    ("input_layernorm", "attn_norm"), ("post_attention_layernorm", "post_attention_norm"),
    ("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"), ("self_attn.v_proj", "attn_v"),
    ("self_attn.o_proj", "attn_output"), ("self_attn.q_norm", "attn_q_norm"),
    ("self_attn.k_norm", "attn_k_norm"), ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"),
    ("mlp.down_proj", "ffn_down"), ("linear_attn.in_proj_qkv", "attn_qkv"),
    ("linear_attn.in_proj_z", "attn_gate"), ("linear_attn.in_proj_ba", "ssm_ba"), ("linear_attn.in_proj_a", "ssm_alpha"),
    ("linear_attn.in_proj_b", "ssm_beta"), ("linear_attn.conv1d", "ssm_conv1d"),
    ("linear_attn.dt_bias", "ssm_dt.bias"), ("linear_attn.A_log", "ssm_a"),
    ("linear_attn.norm", "ssm_norm"), ("linear_attn.out_proj", "ssm_out"),
    ("eh_proj", "nextn.eh_proj"), ("enorm", "nextn.enorm"), ("hnorm", "nextn.hnorm"),
    ("shared_head.norm", "nextn.shared_head_norm"),
    ("mlp.shared_expert_gate", "ffn_gate_inp_shexp"), ("mlp.shared_expert.gate_proj", "ffn_gate_shexp"),
    ("mlp.shared_expert.up_proj", "ffn_up_shexp"), ("mlp.shared_expert.down_proj", "ffn_down_shexp"),
    ("mlp.gate.weight", "ffn_gate_inp.weight"), ("mlp.experts.gate_proj", "ffn_gate_exps"),
    ("mlp.experts.up_proj", "ffn_up_exps"), ("mlp.experts.down_proj", "ffn_down_exps"),
]
MTP_PARTS = {"fc": "eh_proj", "pre_fc_norm_embedding": "enorm", "pre_fc_norm_hidden": "hnorm", "norm": "shared_head.norm"}


def converter_name(name: str, layers: int) -> str:
    """An `mtp.*` name as the converter renames it before its tensor map (block `layers` onward)."""
    parts = name.split(".", 3)
    if parts[0] == "mtp" and parts[1] == "layers":
        return f"model.layers.{layers + int(parts[2])}.{parts[3]}"
    if parts[0] == "mtp":
        return f"model.layers.{layers}.{MTP_PARTS[parts[1]]}.{parts[2]}"
    return name


def gguf_name(name: str) -> str:
    for old, new in RENAMES:
        name = name.replace(old, new)
    return name


def tiled(x: np.ndarray, axis: int, k_heads: int, per_k: int, head_dim: int) -> np.ndarray:
    """Value heads grouped by key head -> tiled along `axis` (the converter's _reorder_v_heads)."""
    shape = list(x.shape)
    x = x.reshape(shape[:axis] + [k_heads, per_k, head_dim] + shape[axis + 1:])
    return np.swapaxes(x, axis, axis + 1).reshape(shape)


def split_qkvz(x: np.ndarray, c: dict) -> tuple[np.ndarray, np.ndarray]:
    """Qwen3-Next's in_proj_qkvz [HK (2 dk + 2 r dv), E], rows grouped per key head -> (attn_qkv:
    all q, all k, all v; attn_gate: z), as Qwen3NextModel.modify_tensors splits it."""
    HK, HV = c["linear_num_key_heads"], c["linear_num_value_heads"]
    dk, dv, r = c["linear_key_head_dim"], c["linear_value_head_dim"], HV // HK
    per = x.reshape(HK, 2 * dk + 2 * r * dv, -1)
    cuts = np.cumsum([dk, dk, r * dv])
    q, k, v, z = np.split(per, cuts, axis=1)
    rows = lambda t: t.reshape(-1, x.shape[1])  # noqa: E731
    return np.concatenate((rows(q), rows(k), rows(v))), rows(z)


def converter_layout(name: str, x: np.ndarray, c: dict) -> np.ndarray:
    """One Hugging Face tensor's values as the converter stores them (before typing)."""
    HK, HV = c["linear_num_key_heads"], c["linear_num_value_heads"]
    dk, dv, r = c["linear_key_head_dim"], c["linear_value_head_dim"], HV // HK
    if HK != HV and "linear_attn." in name and c["model_type"] != "qwen3_next":  # Qwen3.5's classes only
        qk = 2 * HK * dk
        if ".in_proj_qkv." in name:
            x = np.concatenate((x[:qk], tiled(x[qk:], 0, HK, r, dv)))
        elif ".in_proj_z." in name:
            x = tiled(x, 0, HK, r, dv)
        elif ".in_proj_a." in name or ".in_proj_b." in name:
            x = tiled(x, 0, HK, r, 1)
        elif name.endswith((".A_log", ".dt_bias")):
            x = tiled(x[:, None], 0, HK, r, 1)[:, 0]
        elif ".conv1d." in name:
            x = x.squeeze()
            x = np.concatenate((x[:qk], tiled(x[qk:], 0, HK, r, dv)))
        elif ".out_proj." in name:
            x = tiled(x, 1, HK, r, dv)
    if name.endswith(".A_log"):
        import torch

        x = (-torch.exp(torch.from_numpy(x))).numpy()  # torch's exp, as the converter's (numpy's differs in the last bit)
    elif ".conv1d." in name:
        x = x.squeeze()
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        x = x + np.float32(1)
    return x


def typed(gname: str, x: np.ndarray, qtype: str):
    """(data, raw dtype or None) in the type base.py would choose for `qtype`."""
    import gguf

    if qtype == "F32" or x.ndim <= 1 or gname.endswith("_norm.weight") or ".ssm_conv1d." in gname \
            or not gname.endswith(".weight") or ".ffn_gate_inp" in gname:
        return x.astype(np.float32), None
    kind = gguf.GGMLQuantizationType[qtype]
    if qtype in ("Q4_K", "Q6_K"):  # gguf-py has no K-quant quantizer: random blocks (finite scales), not x's values
        from test_quant_convert import random_raw

        if x.ndim != 2 or x.shape[1] % 256:
            return x.astype(np.float16), None
        return random_raw(qtype, x.shape[0], x.shape[1], seed=len(gname)), kind
    try:
        return gguf.quants.quantize(x, kind), kind
    except gguf.QuantError:  # a row that does not split into blocks: F16, as the converter falls back
        return x.astype(np.float16), None


def write_qwen35_gguf(folder: Path, path: Path, qtype: str = "F32", tokenizer: bool = True, mtp: bool = True) -> None:
    """Write `folder` (a Qwen3.5 text model saved by transformers) to `path` as the converter would
    (--outtype f32 / q8_0 for F32 / Q8_0; other types as gguf-py quantizes them, by the same rule;
    Q4_K / Q6_K: random blocks where rows split into 256-value super-blocks, F16 elsewhere;
    mtp=False: as with --no-mtp, the folder's mtp.* tensors left out)."""
    import gguf
    import torch
    from safetensors.torch import load_file

    import test_gguf_import as bpe

    c = json.loads((Path(folder) / "config.json").read_text())
    tensors = load_file(str(next(Path(folder).glob("*.safetensors"))))
    head_dim, layers = c["head_dim"], c["num_hidden_layers"]
    arch = "qwen3next" if c["model_type"] == "qwen3_next" else "qwen35"
    if not mtp:
        tensors = {k: v for k, v in tensors.items() if not k.startswith("mtp.")}
    n_mtp = 1 + max((int(k.split(".")[2]) for k in tensors if k.startswith("mtp.layers.")), default=-1)
    rope = c["rope_parameters"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers + n_mtp)
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    if arch == "qwen3next":
        w.add_expert_count(c["num_experts"])
        w.add_expert_used_count(c["num_experts_per_tok"])
    w.add_file_type({"F32": 0, "Q8_0": 7}.get(qtype, 0))
    if arch == "qwen3next":
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])
        w.add_expert_shared_feed_forward_length(c["shared_expert_intermediate_size"])
    w.add_ssm_conv_kernel(c["linear_conv_kernel_dim"])
    w.add_ssm_state_size(c["linear_key_head_dim"])
    w.add_ssm_group_count(c["linear_num_key_heads"])
    w.add_ssm_time_step_rank(c["linear_num_value_heads"])
    w.add_ssm_inner_size(c["linear_value_head_dim"] * c["linear_num_value_heads"])
    w.add_array(f"{arch}.attention.recurrent_layers", [t == "linear_attention" for t in c["layer_types"]] + [False] * n_mtp)
    w.add_full_attention_interval(c.get("full_attention_interval", 4))
    w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 0.25)))
    if arch == "qwen35":
        w.add_rope_dimension_sections([11, 11, 10, 0])  # the converter's default for Qwen3.5's MRoPE
    if n_mtp:
        w.add_uint32(f"{arch}.nextn_predict_layers", n_mtp)
    w.add_quantization_version(2)
    if tokenizer:
        tokens = bpe._tokenizer_vocab()
        assert len(tokens) == c["vocab_size"], "the model's vocab_size must be the BPE's 264"
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen35")
        w.add_token_list(tokens)
        w.add_token_types([3] * len(bpe.SPECIALS) + [1] * (len(tokens) - len(bpe.SPECIALS)))
        w.add_token_merges(bpe.MERGES)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_bos_token(False)
        w.add_chat_template(bpe.CHATML)
    arrays = {converter_name(k, layers): v.to(torch.float32).numpy() for k, v in tensors.items()}
    for name in [n for n in arrays if ".in_proj_qkvz." in n]:
        qkv, z = split_qkvz(arrays.pop(name), c)
        arrays[name.replace("in_proj_qkvz", "in_proj_qkv")], arrays[name.replace("in_proj_qkvz", "in_proj_z")] = qkv, z
    for name in sorted(n for n in arrays if ".mlp.experts.0." in n):  # experts stacked: [experts, out, in]
        base, part = name.split(".mlp.experts.0.")
        arrays[f"{base}.mlp.experts.{part}"] = np.stack([arrays.pop(f"{base}.mlp.experts.{j}.{part}")
                                                         for j in range(c["num_experts"])])
    for name in sorted(arrays):  # the order is not the converter's (it does not matter to a reader)
        x = converter_layout(name, arrays[name], c)
        gname = gguf_name(name)
        data, kind = typed(gname, x, qtype)
        if kind is None:
            w.add_tensor(gname, data)
        else:
            w.add_tensor(gname, data, raw_shape=data.shape, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
