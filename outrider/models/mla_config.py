"""A latent-attention (MLA) layer's sizes, and how DeepSeek-V2's config.json states them.

    MlaConfig                       what latent_layer.py computes with
    deepseek_mla(raw, interleaved)  the MlaConfig of a DeepSeek-V2 / MiniCPM3 style config.json

The fields, by DeepSeek-V2's names: `q_lora_rank` (queries through a low-rank bottleneck with an
RMS norm, q_a_proj -> q_a_layernorm -> q_b_proj; null: one q_proj), `kv_lora_rank` r (the latent
c_kv every head's keys and values are expanded from, after kv_a_layernorm), `qk_nope_head_dim`
dn and `qk_rope_head_dim` dr (each query/key head: dn dimensions without position, then dr
rotated; the rotated key is one per token, shared by every head), `v_head_dim` dv. The scores'
scale is (dn + dr) ** -0.5, times YaRN's mscale(factor, mscale_all_dim) squared where the RoPE is
YaRN's (transformers' yarn_apply_mscale). The latent and q LoRA norms use eps 1e-6 whatever
rms_norm_eps says (DeepseekV2RMSNorm's default: transformers builds them without the config's).

A model converted to MLA (scripts/convert_mla.py: Outrider's own `Mha2MlaForCausalLM`, mha2mla.py) keeps one
rotated key per K/V head of its source (`qk_rope_heads`), and no norm on its latent
(`kv_latent_norm: false`): the conversion is linear, and a norm would change it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ModelError

LATENT_NORM_EPS = 1e-6  # DeepseekV2RMSNorm's default, which transformers' MLA norms keep


@dataclass(frozen=True)
class MlaConfig:
    heads: int  # H query heads
    q_rank: int  # q_lora_rank; 0: one q_proj
    kv_rank: int  # r, the latent's width
    nope_dim: int  # dn, a head's query/key dimensions without position
    rope_dim: int  # dr, a head's rotated query/key dimensions
    v_dim: int  # dv, a head's value dimensions
    scale: float  # the scores' scale
    rope_heads: int = 1  # rotated keys a token (DeepSeek: 1, shared by every head; a converted GQA: its K/V heads)
    latent_norm: bool = True  # kv_a_layernorm on the latent (False: a converted model's, scripts/convert_mla.py)
    interleaved: bool = False  # RoPE on (2i, 2i+1) pairs (DeepSeek-V2); the loader reorders them to halves

    def __post_init__(self):
        if min(self.kv_rank, self.rope_dim, self.v_dim) <= 0 or self.nope_dim < 0 or self.rope_dim % 2:
            raise ModelError(f"latent attention needs positive kv_lora_rank, v_head_dim, an even qk_rope_head_dim and "
                             f"qk_nope_head_dim >= 0 (got {self.kv_rank}, {self.v_dim}, {self.rope_dim}, {self.nope_dim})")
        if self.heads % self.rope_heads:
            raise ModelError(f"qk_rope_heads {self.rope_heads} does not divide num_attention_heads {self.heads}")

    @property
    def qk_dim(self) -> int:
        return self.nope_dim + self.rope_dim

    @property
    def row_width(self) -> int:
        """What a token keeps in a layer's cache: the latent then each rotated key."""
        return self.kv_rank + self.rope_heads * self.rope_dim


def _mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def deepseek_mla(raw: dict, interleaved: bool, converted: bool = False) -> MlaConfig:
    """The MlaConfig of a DeepSeek-V2-layout config.json (transformers' DeepseekV2Attention);
    converted: also read a converted model's own fields (qk_rope_heads, kv_latent_norm)."""
    heads = int(raw["num_attention_heads"])
    nope, rope = int(raw["qk_nope_head_dim"]), int(raw["qk_rope_head_dim"])
    scale = (nope + rope) ** -0.5
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind != "default" and params.get("mscale_all_dim"):
        m = _mscale(float(params["factor"]), float(params["mscale_all_dim"]))
        scale = scale * m * m
    return MlaConfig(heads=heads, q_rank=int(raw.get("q_lora_rank") or 0), kv_rank=int(raw["kv_lora_rank"]),
                     nope_dim=nope, rope_dim=rope, v_dim=int(raw.get("v_head_dim") or raw["hidden_size"] // heads),
                     scale=scale, rope_heads=int(raw.get("qk_rope_heads") or 1) if converted else 1,
                     latent_norm=bool(raw.get("kv_latent_norm", True)) if converted else True,
                     interleaved=interleaved)
