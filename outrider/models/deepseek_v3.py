"""DeepSeek-V3 (`DeepseekV3ForCausalLM`): DeepSeek-V2's block (multi-head latent attention,
latent_layer.py; dense MLPs in the first `first_k_dense_replace` layers) with V3's MoE router
(deepseek_moe.py: sigmoid scores, e_score_correction_bias for choosing only, groups scored by
their best two experts, renormalised, times routed_scaling_factor; ungated shared experts).

Its RoPE turns interleaved pairs where `rope_interleave` is true (its default; the loader reorders
them into halves, as for V2), halves otherwise. Its multi-token-prediction module
(`num_nextn_predict_layers`) is not part of transformers' forward: its tensors, where a
checkpoint keeps them, are refused at load as tensors the runtime does not read.
"""

from .deepseek_moe import deepseek_mlp_kinds, deepseek_moe
from .family import LATENT, Family
from .mla_config import deepseek_mla

FAMILY = Family(
    name="deepseek_v3",
    architectures=("DeepseekV3ForCausalLM",),
    qkv_bias=lambda raw: False,
    qk_norm=False,
    layer_kinds=lambda raw: (LATENT,) * int(raw["num_hidden_layers"]),
    mla=lambda raw: deepseek_mla(raw, interleaved=bool(raw.get("rope_interleave", True))),
    mlp_kinds=lambda raw: deepseek_mlp_kinds(raw, 3),
    moe=lambda raw: deepseek_moe(raw, 3),
)
