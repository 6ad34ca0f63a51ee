"""Qwen3-Next: the Qwen3.5 hybrid (gated-delta layers, gated attention every fourth layer, (1 + w)
norms, partial rotary) with mixture-of-experts MLPs.

What differs from Qwen3.5 (qwen3_5.py), read from its config.json and tensor names:
- the gated-delta projections are two tensors, `in_proj_qkvz` and `in_proj_ba`, whose rows are
  grouped per key head (each key head's q, k, then its value heads' v and z; its value heads' b,
  then a); the loader reorders them into the one in_proj the gated-delta mixer reads
  (delta_layer.py), the same arithmetic;
- each layer's MLP is a sparse MoE block (moe_layer.py: a softmax router's top `num_experts_per_tok`
  of `num_experts` SwiGLU experts, renormalised when `norm_topk_prob`, plus a shared expert scaled
  by sigmoid of its gate) where `decoder_sparse_step` and `mlp_only_layers` say so
  (moe_config.py), the dense SwiGLU MLP elsewhere.
"""

from .family import Family
from .moe_config import qwen_mlp_kinds, qwen_moe
from .qwen3_5 import layer_kinds

FAMILY = Family(
    name="qwen3_next",
    architectures=("Qwen3NextForCausalLM",),
    qkv_bias=lambda raw: False,
    qk_norm=True,
    layer_kinds=layer_kinds,
    attn_output_gate=True,
    norm_plus_one=True,
    mlp_kinds=qwen_mlp_kinds,
    moe=lambda raw: qwen_moe(raw, shared=True, norm_default=True),
    delta_grouped=True,
    reads=frozenset({"layer_types", "partial_rotary_factor", "rope_parameters", "num_experts",
                     "num_local_experts"}),
)
