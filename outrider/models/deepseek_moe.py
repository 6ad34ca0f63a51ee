"""DeepSeek's mixture-of-experts MLPs, as their config.json states them, onto the MoE MLP kind
(moe_config.MoeConfig; moe_layer.py computes them):

    deepseek_mlp_kinds(raw)     each layer's MLP kind: dense before `first_k_dense_replace`, MoE after
    deepseek_moe(raw, version)  the MoeConfig of a DeepSeek-V2 (version 2) or V3 (version 3) config

Both: `n_routed_experts` experts of `moe_intermediate_size` chosen `num_experts_per_tok` a token,
their weights times `routed_scaling_factor`, plus `n_shared_experts` shared experts run as one
ungated SwiGLU of n_shared_experts x moe_intermediate_size (`mlp.shared_experts.*`); the router's
logits from float32 inputs and weights (transformers' DeepseekV2TopkRouter, DeepseekV3TopkRouter).

- V2: softmax scores; `topk_method` "greedy" (the best k), or "group_limited_greedy" (the experts
  in `n_group` groups, a group scored by its best expert, the best k within the best `topk_group`
  groups); no renormalisation (transformers' V2 router ignores `norm_topk_prob`, and DeepSeek's own
  code renormalises *instead of* scaling: the two disagree where it is true, so it is refused).
- V3 ("noaux_tc"): sigmoid scores; `gate.e_score_correction_bias` added for choosing only; groups
  scored by their best two experts' sum; the chosen weights renormalised when `norm_topk_prob`.

Which layers: transformers makes layer i sparse from i = first_k_dense_replace on; DeepSeek's own
code also asks i % moe_layer_freq == 0, which transformers ignores: a moe_layer_freq other than 1
is refused. A config whose n_routed_experts is null (or 0) is dense everywhere (DeepSeek's code).
"""

from __future__ import annotations

from ..errors import ModelError
from .family import DENSE, MOE
from .moe_config import MoeConfig

TOPK_METHODS = {2: ("greedy", "group_limited_greedy"), 3: ("noaux_tc",)}
SCORING = {2: "softmax", 3: "sigmoid"}
# where a config.json leaves a field out, its transformers config class's default
DEFAULTS = {2: dict(first_k_dense_replace=0, n_routed_experts=64, n_shared_experts=2, routed_scaling_factor=1.0,
                    n_group=None, topk_group=None, moe_intermediate_size=1407),
            3: dict(first_k_dense_replace=3, n_routed_experts=256, n_shared_experts=1, routed_scaling_factor=2.5,
                    n_group=8, topk_group=4, moe_intermediate_size=2048, num_experts_per_tok=8)}


def _field(raw: dict, version: int, name: str):
    return raw[name] if name in raw else DEFAULTS[version].get(name)


def deepseek_mlp_kinds(raw: dict, version: int) -> tuple[str, ...]:
    layers = int(raw["num_hidden_layers"])
    freq = raw.get("moe_layer_freq")
    if freq not in (None, 1):
        raise ModelError(f"moe_layer_freq: {freq} (DeepSeek's own code: MoE every {freq}th layer; transformers: "
                         "every layer from first_k_dense_replace on) is not supported yet: the two disagree")
    dense = int(_field(raw, version, "first_k_dense_replace") or 0)
    experts = int(_field(raw, version, "n_routed_experts") or 0)
    return tuple(MOE if experts and i >= dense else DENSE for i in range(layers))


def deepseek_moe(raw: dict, version: int) -> MoeConfig:
    name = f"deepseek_v{version}"
    method = raw.get("topk_method") or TOPK_METHODS[version][0]
    if method not in TOPK_METHODS[version]:
        raise ModelError(f"{name}: topk_method {method!r} is not supported (supported: "
                         f"{', '.join(TOPK_METHODS[version])})")
    scoring = raw.get("scoring_func") or SCORING[version]  # DeepSeek's own configs name it
    if scoring != SCORING[version]:
        raise ModelError(f"{name}: scoring_func {scoring!r} is not supported ({name}'s router is {SCORING[version]})")
    norm = bool(raw.get("norm_topk_prob", version == 3))
    if version == 2 and norm:
        raise ModelError(f"{name}: norm_topk_prob: true is not supported: transformers' DeepSeek-V2 router ignores "
                         "it and DeepSeek's own code renormalises instead of scaling by routed_scaling_factor")
    grouped = method != "greedy"
    if grouped and not (_field(raw, version, "n_group") and _field(raw, version, "topk_group")):
        raise ModelError(f"{name}: topk_method {method!r} needs n_group and topk_group (got "
                         f"{_field(raw, version, 'n_group')}, {_field(raw, version, 'topk_group')})")
    size = int(_field(raw, version, "moe_intermediate_size"))
    scale = _field(raw, version, "routed_scaling_factor")
    return MoeConfig(num_experts=int(_field(raw, version, "n_routed_experts")),
                     top_k=int(_field(raw, version, "num_experts_per_tok")), expert_size=size, norm_topk_prob=norm,
                     shared_size=size * int(_field(raw, version, "n_shared_experts") or 0), shared_gate=False,
                     scoring=scoring, shared_name="shared_experts", router_float32=True,
                     n_group=int(_field(raw, version, "n_group") or 1) if grouped else 1,
                     topk_group=int(_field(raw, version, "topk_group") or 1) if grouped else 1,
                     group_score="top2" if version == 3 else "max", score_bias=version == 3,
                     routed_scale=1.0 if scale is None else float(scale))
