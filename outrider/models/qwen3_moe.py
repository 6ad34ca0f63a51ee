"""Qwen3-MoE (Qwen3MoeForCausalLM: Qwen3-30B-A3B, Qwen3-235B-A22B, ...): Qwen3's attention (RMS
norms on each head's queries and keys, no biases) with mixture-of-experts MLPs.

Its MLPs (moe_config.py qwen_mlp_kinds, qwen_moe; computed by moe_layer.py): a softmax router's top
`num_experts_per_tok` of `num_experts` SwiGLU experts of `moe_intermediate_size`, renormalised over
the chosen when `norm_topk_prob` (false where the config leaves it out, as Qwen3MoeConfig's
default), no shared expert; layer i is sparse when (i + 1) is a multiple of `decoder_sparse_step`
and i is not in `mlp_only_layers`, dense (a SwiGLU of `intermediate_size`) otherwise.
transformers 5 names the experts' count `num_local_experts` in the config it writes.
"""

from .family import Family
from .moe_config import qwen_mlp_kinds, qwen_moe

FAMILY = Family(
    name="qwen3_moe",
    architectures=("Qwen3MoeForCausalLM",),
    qkv_bias=lambda raw: bool(raw.get("attention_bias", False)),
    qk_norm=True,
    mlp_kinds=qwen_mlp_kinds,
    moe=lambda raw: qwen_moe(raw, shared=False, norm_default=False),
    reads=frozenset({"num_experts", "num_local_experts"}),
)
