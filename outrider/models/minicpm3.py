"""MiniCPM3 (`MiniCPM3ForCausalLM`): DeepSeek-V2's latent attention (latent_layer.py) with RoPE on
halves (Llama's, not DeepSeek's interleaved pairs), the dense SwiGLU MLP, and three scalings read
from its config.json: embeddings times `scale_emb`, each residual branch (attention's and the
MLP's output) times `scale_depth / sqrt(num_hidden_layers)`, and the final norm's output divided
by `hidden_size / dim_model_base` before the (tied) head. MiniCPM3-4B's own RoPE is longrope
(models/rope.py: its short factors, over its whole 32,768-token context).
"""

import math

from .family import LATENT, Family
from .mla_config import deepseek_mla


def _scalings(raw: dict) -> dict:
    layers = int(raw["num_hidden_layers"])
    depth = raw.get("scale_depth")
    base = raw.get("dim_model_base")
    return dict(embed_multiplier=float(raw.get("scale_emb") or 1.0),
                residual_scale=1.0 if depth is None else float(depth) / math.sqrt(layers),
                logit_divisor=1.0 if base is None else int(raw["hidden_size"]) / float(base))


FAMILY = Family(
    name="minicpm3",
    architectures=("MiniCPM3ForCausalLM",),
    qkv_bias=lambda raw: False,
    qk_norm=False,
    layer_kinds=lambda raw: (LATENT,) * int(raw["num_hidden_layers"]),
    mla=lambda raw: deepseek_mla(raw, interleaved=False),
    extras=_scalings,
    reads=frozenset({"scale_emb", "scale_depth", "dim_model_base"}),
)
