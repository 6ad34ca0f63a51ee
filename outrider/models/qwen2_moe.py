"""Qwen2-MoE (Qwen2MoeForCausalLM: Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B, and the mixtures of experts
train/moe_split.py makes from the packaged dense models): Qwen2's attention (biases on q, k and v,
no q/k norms) with mixture-of-experts MLPs.

Its MLPs (moe_config.py qwen_mlp_kinds, qwen_moe; computed by moe_layer.py): a softmax router's top
`num_experts_per_tok` of `num_experts` SwiGLU experts of `moe_intermediate_size`, renormalised over
the chosen when `norm_topk_prob` (false where the config leaves it out, as Qwen2MoeConfig's
default), plus a shared SwiGLU expert of `shared_expert_intermediate_size` weighted by
sigmoid(shared_expert_gate); layer i is sparse when (i + 1) is a multiple of `decoder_sparse_step`
and i is not in `mlp_only_layers`, dense otherwise. Sliding windows (`use_sliding_window`) are
refused by config_fields.py, as for any family that does not read them.
"""

from .family import Family
from .moe_config import qwen_mlp_kinds, qwen_moe

FAMILY = Family(
    name="qwen2_moe",
    architectures=("Qwen2MoeForCausalLM",),
    qkv_bias=lambda raw: bool(raw.get("qkv_bias", True)),
    qk_norm=False,
    mlp_kinds=qwen_mlp_kinds,
    moe=lambda raw: qwen_moe(raw, shared=True, norm_default=False),
    reads=frozenset({"num_experts", "num_local_experts"}),
)
