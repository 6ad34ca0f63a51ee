"""What tells one decoder family from another: a few switches read from its config.json, the
kind of each layer's token mixer, and the kind of each layer's MLP."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

ATTENTION, GATED_DELTA = "attention", "gated_delta"  # the layer kinds (models/decoder.py runs each)
LATENT = "latent_attention"  # multi-head latent attention (DeepSeek-V2, MiniCPM3: latent_layer.py)
DENSE, MOE = "dense", "moe"  # the MLP kinds: SwiGLU (layers.swiglu_mlp), a mixture of experts (moe_layer.py)


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]
    qkv_bias: Callable[[dict], bool]  # from the raw config.json
    qk_norm: bool  # RMS norm on each head's queries and keys before rotary
    # with qk_norm: one RMS norm over all the queries (q_norm [H D]) and one over all the keys
    # (k_norm [G D]) of a token, before they split into heads (OLMoE's), not one a head
    qk_norm_whole: bool = False
    # each layer's mixer kind from the raw config (default: attention everywhere)
    layer_kinds: Callable[[dict], tuple[str, ...]] = lambda raw: (ATTENTION,) * int(raw["num_hidden_layers"])
    attn_output_gate: bool = False  # attention's output times sigmoid of a second half of q_proj (Qwen3.5)
    # ModelConfig fields the family reads from the raw config itself (Gemma 3's sliding windows,
    # its local RoPE, attention scale, sandwich norms, scaled embeddings, GELU MLP: models/gemma3.py)
    extras: Callable[[dict], dict] = lambda raw: {}
    norm_plus_one: bool = False  # RMS norms scale by (1 + weight) (zero-centred weights, Qwen3.5)
    # each layer's MLP kind from the raw config (default: the dense SwiGLU everywhere), and the
    # MoeConfig of its sparse layers (moe_config.py: qwen_mlp_kinds, qwen_moe); None without
    mlp_kinds: Callable[[dict], tuple[str, ...]] = lambda raw: (DENSE,) * int(raw["num_hidden_layers"])
    moe: Callable[[dict], object] = lambda raw: None
    # the gated-delta in_proj as Qwen3-Next keeps it: in_proj_qkvz and in_proj_ba, rows grouped per
    # key head (weights/loader.py reorders them); False: Qwen3.5's in_proj_qkv, _z, _b, _a
    delta_grouped: bool = False
    # the latent-attention layers' MlaConfig (mla_config.py: deepseek_mla) where layer_kinds names LATENT
    mla: Callable[[dict], object] = lambda raw: None
    reads: frozenset = field(default_factory=frozenset)  # checked config fields it implements (config_fields.py)
    # a vision-language model's (models/idefics3.py): its text model's raw config, named for the text
    # family that runs it (the decoder), and its vision tower's VisionConfig; None for a text model
    text_config: Callable[[dict], dict] | None = None
    vision: Callable[[dict], object] = lambda raw: None
