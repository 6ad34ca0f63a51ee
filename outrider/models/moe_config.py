"""A mixture-of-experts MLP's configuration, and how the Qwen MoE configs state it.

    MoeConfig                       the router and the experts' sizes (moe_layer.py computes with it)
    qwen_mlp_kinds(raw)             each layer's MLP kind: family.MOE or family.DENSE
    qwen_moe(raw)                   the MoeConfig of a Qwen MoE config.json

Qwen2-MoE, Qwen3-MoE and Qwen3-Next write the same fields: `num_experts` routed experts
(`num_local_experts` in transformers 5's Qwen3MoeConfig) of `moe_intermediate_size`,
`num_experts_per_tok` chosen by a softmax router (renormalised over the chosen when
`norm_topk_prob`), a shared expert of `shared_expert_intermediate_size` scaled by
sigmoid of its own gate (Qwen2-MoE, Qwen3-Next; none in Qwen3-MoE), and which layers are sparse:
every `decoder_sparse_step`-th layer but those in `mlp_only_layers`, which keep the dense SwiGLU
MLP of `intermediate_size`. Other families add readers of their own fields onto the same
MoeConfig (DeepSeek-V2 and V3: deepseek_moe.py, whose router switches on the fields after
`scoring` below).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ModelError
from .family import DENSE, MOE

SCORINGS = ("softmax", "sigmoid")  # router scorings moe_layer.route implements (sigmoid: DeepSeek-V3's)
GROUP_SCORES = ("max", "top2")  # how a group of experts scores (DeepSeek-V2's group_limited_greedy, V3's noaux_tc)


@dataclass(frozen=True)
class MoeConfig:
    num_experts: int  # N routed experts
    top_k: int  # experts chosen per token
    expert_size: int  # each routed expert's intermediate size I_e
    norm_topk_prob: bool  # the chosen experts' probabilities renormalised to sum to 1
    shared_size: int = 0  # the shared expert's intermediate size; 0: no shared expert
    shared_gate: bool = False  # the shared expert's output times sigmoid(x . w) (Qwen's shared_expert_gate)
    scoring: str = "softmax"  # how router logits become probabilities
    # DeepSeek's router (deepseek_moe.py); the defaults are Qwen's, which none of these change
    shared_name: str = "shared_expert"  # the shared expert's tensors' name (DeepSeek: shared_experts)
    router_float32: bool = False  # router logits from float32 inputs and weights (transformers' DeepSeek routers)
    n_group: int = 1  # experts in n_group equal groups, each row choosing among its topk_group best
    topk_group: int = 1  # groups (1 group: no group selection)
    group_score: str = "max"  # a group's score: its best expert's ("max") or its best two's sum ("top2")
    score_bias: bool = False  # a per-expert bias added to the scores for choosing only (V3's e_score_correction_bias)
    routed_scale: float = 1.0  # the chosen experts' weights times this (routed_scaling_factor)
    # the chosen experts' weights kept float32 and each expert's output times its weight in float32,
    # rounded to the compute dtype before the sum (transformers' Mixtral); False: weights in x's dtype
    weights_float32: bool = False

    def __post_init__(self):
        if not 0 < self.top_k <= self.num_experts:
            raise ModelError(f"num_experts_per_tok {self.top_k} must be between 1 and num_experts {self.num_experts}")
        if self.scoring not in SCORINGS:
            raise ModelError(f"a {self.scoring} router is not supported yet (supported: {', '.join(SCORINGS)})")
        if self.n_group < 1 or self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
            raise ModelError(f"n_group {self.n_group} must divide n_routed_experts {self.num_experts}, and topk_group "
                             f"{self.topk_group} be between 1 and n_group")
        if self.group_score not in GROUP_SCORES:
            raise ModelError(f"a group score {self.group_score!r} is not supported (supported: {', '.join(GROUP_SCORES)})")
        if self.n_group > 1 and self.top_k > self.topk_group * (self.num_experts // self.n_group):
            raise ModelError(f"num_experts_per_tok {self.top_k} is more than the topk_group {self.topk_group} groups "
                             f"of {self.num_experts // self.n_group} experts hold")
        if self.n_group > 1 and self.group_score == "top2" and self.num_experts // self.n_group < 2:
            raise ModelError(f"noaux_tc scores a group by its best two experts: n_group {self.n_group} leaves "
                             f"{self.num_experts // self.n_group} a group")


def experts_of(raw: dict) -> int:
    """The routed experts' count: `num_experts`, or `num_local_experts` (Mixtral's name, and the one
    transformers 5's Qwen3MoeConfig writes); 0: none."""
    return int(raw.get("num_experts") or raw.get("num_local_experts") or 0)


def qwen_mlp_kinds(raw: dict) -> tuple[str, ...]:
    """Layer i is sparse when num_experts > 0, i is not in mlp_only_layers and (i + 1) is a multiple
    of decoder_sparse_step (transformers' Qwen3NextDecoderLayer, Qwen3MoeDecoderLayer)."""
    layers = int(raw["num_hidden_layers"])
    experts = experts_of(raw)
    step = int(raw.get("decoder_sparse_step") or 1)
    dense = set(raw.get("mlp_only_layers") or ())
    return tuple(MOE if experts > 0 and i not in dense and (i + 1) % step == 0 else DENSE for i in range(layers))


def qwen_moe(raw: dict, shared: bool, norm_default: bool) -> MoeConfig:
    """shared: the family has Qwen's gated shared expert (Qwen2-MoE, Qwen3-Next); norm_default:
    norm_topk_prob where the config leaves it out (its transformers config class's default:
    Qwen3-Next true, Qwen2-MoE and Qwen3-MoE false)."""
    return MoeConfig(num_experts=experts_of(raw), top_k=int(raw["num_experts_per_tok"]),
                     expert_size=int(raw["moe_intermediate_size"]),
                     norm_topk_prob=bool(raw.get("norm_topk_prob", norm_default)),
                     shared_size=int(raw["shared_expert_intermediate_size"]) if shared else 0, shared_gate=shared)
