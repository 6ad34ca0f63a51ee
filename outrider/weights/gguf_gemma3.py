"""A Gemma 3 GGUF (llama.cpp architecture `gemma3`) read under Hugging Face's names, with what
llama.cpp's converter changed undone.

What the converter writes (llama.cpp's convert_hf_to_gguf.py, conversion/gemma.py Gemma3Model,
and src/models/gemma3.cpp for what the runtime assumes; read in llama-cpp-python 0.3.36's
vendored copy), and how it is read back here:

- names: Llama's, and `post_attention_norm` (the norm on the attention's output, Hugging Face's
  `post_attention_layernorm`), `ffn_norm` (the MLP's input norm: `pre_feedforward_layernorm`, where
  a Llama's ffn_norm is its post_attention_layernorm), `post_ffw_norm`
  (`post_feedforward_layernorm`). `hf_name` maps the three; Q and K are not permuted (Gemma's
  RoPE is NeoX-style, rotate-half, as Hugging Face's).
- every RMS norm (`*norm.weight`: input, both sandwich norms, the MLP's input, q_norm, k_norm, the
  final norm) is stored with Gemma's 1 added (the (1 + w) scale folded); `undo_float` subtracts it,
  so the folder holds Hugging Face's values and the loader adds it back (models/config.py
  norm_plus_one). On the packaged Gemma 3 270M this round trip gives every one of its 55,936 norm
  values back bit for bit (w - 1 and then + 1 are exact in float32 for each of them).
- the embedding keeps only the tokenizer's rows (262,144 for the 270M), which is its vocab_size.
- metadata it leaves out and llama.cpp's runtime assumes for gemma3: every sixth layer global and
  the others sliding-window (`attention.sliding_window_pattern` when present: an int, or a bool
  per layer), the sliding layers' RoPE base 10,000 (`rope.freq_base_swa` when present), and the
  attention scale 1 / sqrt(head_dim), 1 / sqrt(hidden / heads) for the 27B (62 layers).
"""

from __future__ import annotations

import re

import numpy as np

ARCH = "gemma3"
MODEL = ("gemma3_text", "Gemma3ForCausalLM")  # Hugging Face model_type, architecture

# gguf name within a block -> Hugging Face name within `model.layers.N.`
LAYER_TENSORS = {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def hf_name(gguf_name: str) -> str | None:
    """A Gemma 3 block tensor's Hugging Face name where it differs from a Llama's; else None."""
    match = _BLOCK.fullmatch(gguf_name)
    if match and match.group(2) in LAYER_TENSORS:
        return f"model.layers.{match.group(1)}.{LAYER_TENSORS[match.group(2)]}"
    return None


def undo_float(hf_tensor: str, values: np.ndarray) -> np.ndarray:
    """A tensor's float32 values as Hugging Face keeps them: the norms less the folded 1."""
    return values - np.float32(1.0) if hf_tensor.endswith("norm.weight") else values


def sliding_layers(meta: dict, layers: int) -> list[bool]:
    """Which layers attend within the window: llama.cpp's gemma3 rule (its load_swa_pattern)."""
    pattern = meta.get(f"{ARCH}.attention.sliding_window_pattern", 6)
    if isinstance(pattern, (list, tuple)):
        return [bool(p) for p in pattern][:layers]
    n = int(pattern)
    return [n == 0 or i % n < n - 1 for i in range(layers)]


def config_fields(meta: dict, hidden: int, heads: int, head_dim: int, layers: int) -> dict:
    """config.json's Gemma 3 fields from the GGUF's metadata (gguf_convert.hf_config)."""
    key = lambda name, default=None: meta.get(f"{ARCH}.{name}", default)  # noqa: E731
    window = key("attention.sliding_window")
    swa = sliding_layers(meta, layers) if window else [False] * layers
    local = float(np.float32(key("rope.freq_base_swa", 10000.0)))
    scalar = hidden // heads if layers == 62 else head_dim  # llama.cpp: the 27B scales by hidden / heads
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": int(window) if window else None,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in swa],
        "query_pre_attn_scalar": scalar,
        "final_logit_softcapping": key("final_logit_softcapping"),
        "attn_logit_softcapping": None,
        "local_rope_theta": local,
    }
