"""OLMoE (OlmoeForCausalLM: OLMoE-1B-7B): Llama's attention with RMS norms on the queries and keys
taken over the whole projection, a token's H D queries (q_norm [H D]) and its G D keys (k_norm
[G D]) each normed as one vector before they split into heads (family.qk_norm_whole; Qwen3's
norms are one a head), and a mixture-of-experts MLP in every layer.

Its MLP (moe_layer.py): a softmax router over `num_experts` SwiGLU experts of
`intermediate_size`, the top `num_experts_per_tok`, renormalised only when `norm_topk_prob`
(false in OLMoE's configs and OlmoeConfig's default: the chosen experts' raw probabilities), no
shared expert. `clip_qkv` (a clamp of q, k and v) is refused when set (models/config_fields.py).
"""

from .family import MOE, Family
from .moe_config import MoeConfig, experts_of


def mlp_kinds(raw: dict) -> tuple[str, ...]:
    return (MOE,) * int(raw["num_hidden_layers"])


def moe(raw: dict) -> MoeConfig:
    return MoeConfig(num_experts=experts_of(raw), top_k=int(raw["num_experts_per_tok"]),
                     expert_size=int(raw["intermediate_size"]), norm_topk_prob=bool(raw.get("norm_topk_prob", False)))


FAMILY = Family(
    name="olmoe",
    architectures=("OlmoeForCausalLM",),
    qkv_bias=lambda raw: False,
    qk_norm=True,
    qk_norm_whole=True,
    mlp_kinds=mlp_kinds,
    moe=moe,
    reads=frozenset({"num_experts", "num_local_experts"}),
)
