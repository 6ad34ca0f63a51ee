"""DeepSeek-V2 (`DeepseekV2ForCausalLM`) with dense MLPs: Llama's block with multi-head latent
attention (latent_layer.py; sizes in mla_config.py) in every layer.

Its RoPE turns interleaved pairs (2i, 2i + 1) of each head's rotated dimensions (transformers'
complex `apply_rotary_emb`); the loader reorders those rows of q_proj (or q_b_proj) and of
kv_a_proj_with_mqa into halves order (even dimensions, then odd), where the runtime's rotation
turns pairs (i, i + dr / 2) at the same frequency: the same scores, since a query and a key are
permuted alike. YaRN RoPE (DeepSeek-V2's own long-context configs) runs with its attention factor
on cos and sin (rope.py) and its mscale_all_dim in the scores' scale (mla_config.py).

Its MoE layers (from layer `first_k_dense_replace` on) are DeepSeek's: a softmax router chosen
greedily or group-limited, times routed_scaling_factor, plus ungated shared experts
(deepseek_moe.py, computed by the MoE MLP kind, moe_layer.py); the first layers keep the dense
SwiGLU MLP. DeepSeek-V3 (deepseek_v3.py) is this family with V3's router.
"""

from .deepseek_moe import deepseek_mlp_kinds, deepseek_moe
from .family import LATENT, Family
from .mla_config import deepseek_mla

FAMILY = Family(
    name="deepseek_v2",
    architectures=("DeepseekV2ForCausalLM",),
    qkv_bias=lambda raw: False,
    qk_norm=False,
    layer_kinds=lambda raw: (LATENT,) * int(raw["num_hidden_layers"]),
    mla=lambda raw: deepseek_mla(raw, interleaved=True),
    mlp_kinds=lambda raw: deepseek_mlp_kinds(raw, 2),
    moe=lambda raw: deepseek_moe(raw, 2),
)
