"""Mixtral (MixtralForCausalLM: Mixtral 8x7B, 8x22B): Mistral's attention (no biases, no q/k norms,
`sliding_window` on every layer where set and shorter than the context, as mistral.py) with a
mixture-of-experts MLP in every layer.

Its MLP (moe_layer.py): a softmax router (`block_sparse_moe.gate`) over `num_local_experts` SwiGLU
experts of `intermediate_size`, the top `num_experts_per_tok` (2) always renormalised to sum to 1
(transformers' MixtralTopKRouter; the config has no norm_topk_prob), no shared expert. The
checkpoint keeps Mixtral's names, `block_sparse_moe.experts.{e}.w1 / w3 / w2` (gate, up, down),
which transformers 5 writes too (weights/mlp_load.py reads them). Its chosen experts' weights stay
float32 and multiply each expert's output in float32 before it is rounded to the compute dtype, as
transformers' Mixtral does (MoeConfig.weights_float32: a bfloat16 load's MoE block is then
transformers' bit for bit). `router_jitter_noise` is training's only.
"""

from .family import MOE, Family
from .mistral import windows
from .moe_config import MoeConfig, experts_of


def mlp_kinds(raw: dict) -> tuple[str, ...]:
    return (MOE,) * int(raw["num_hidden_layers"])


def moe(raw: dict) -> MoeConfig:
    return MoeConfig(num_experts=experts_of(raw), top_k=int(raw.get("num_experts_per_tok", 2)),
                     expert_size=int(raw["intermediate_size"]), norm_topk_prob=True, weights_float32=True)


FAMILY = Family(
    name="mixtral",
    architectures=("MixtralForCausalLM",),
    qkv_bias=lambda raw: False,
    qk_norm=False,
    extras=windows,
    mlp_kinds=mlp_kinds,
    moe=moe,
    reads=frozenset({"sliding_window", "num_local_experts", "num_experts"}),
)
