"""DeepSeek-V2 (`DeepseekV2ForCausalLM`) with dense MLPs: Llama's block with multi-head latent
attention (latent_layer.py; sizes in mla_config.py) in every layer.

Its RoPE turns interleaved pairs (2i, 2i + 1) of each head's rotated dimensions (transformers'
complex `apply_rotary_emb`); the loader reorders those rows of q_proj (or q_b_proj) and of
kv_a_proj_with_mqa into halves order (even dimensions, then odd), where the runtime's rotation
turns pairs (i, i + dr / 2) at the same frequency: the same scores, since a query and a key are
permuted alike. YaRN RoPE (DeepSeek-V2's own long-context configs) runs with its attention factor
on cos and sin (rope.py) and its mscale_all_dim in the scores' scale (mla_config.py).

Its MoE layers (from layer `first_k_dense_replace` on: DeepSeek's router with routed_scaling_factor,
group-limited top-k and ungated shared experts, which the MoE MLP kind does not compute yet) are
refused in one line naming first_k_dense_replace (`_mlp_kinds` below); a config whose
first_k_dense_replace covers every layer, or whose n_routed_experts is null, is dense and runs.
"""

from ..errors import ModelError
from .family import DENSE, LATENT, Family
from .mla_config import deepseek_mla


def _mlp_kinds(raw: dict) -> tuple[str, ...]:
    """Dense everywhere, or a one-line refusal: transformers makes layer i a DeepSeek MoE from
    i = first_k_dense_replace on (0 where the field is absent); DeepSeek's own code keeps every layer
    dense where n_routed_experts is null (or 0)."""
    layers, dense = int(raw["num_hidden_layers"]), int(raw.get("first_k_dense_replace") or 0)
    if dense < layers and raw.get("n_routed_experts", 64):
        raise ModelError(f"deepseek_v2: mixture-of-experts layers (first_k_dense_replace: {dense} of {layers} "
                         f"layers; n_routed_experts: {raw.get('n_routed_experts')}) are not supported yet: DeepSeek's "
                         "router (routed_scaling_factor, group-limited top-k, ungated shared_experts) is not the "
                         "MoE MLP kind's; a config whose first_k_dense_replace covers every layer runs")
    return (DENSE,) * layers

FAMILY = Family(
    name="deepseek_v2",
    architectures=("DeepseekV2ForCausalLM",),
    qkv_bias=lambda raw: False,
    qk_norm=False,
    layer_kinds=lambda raw: (LATENT,) * int(raw["num_hidden_layers"]),
    mla=lambda raw: deepseek_mla(raw, interleaved=True),
    mlp_kinds=_mlp_kinds,
)
