"""Each MLP kind's weights under Hugging Face's names (weights/loader.py reads one a layer).

    mlp_weights(prefix, kind, config, source) -> {gate_up, down, moe}: LayerWeights' MLP fields

`prefix` is the layer's "model.layers.{i}.mlp."; `source` reads by name (`get`: a float tensor,
`proj`: a projection, fused along its rows and kept quantized where the load quantizes, `has`).

- dense (family.DENSE): gate_proj, up_proj (fused: gate rows then up rows), down_proj.
- a mixture of experts (family.MOE, Qwen's sparse block): the router `gate.weight` [N, E] (kept
  float: it chooses, it is small); each expert's `experts.{e}.gate_proj / up_proj / down_proj`
  (what transformers 5's save_pretrained writes and the hub keeps), each expert quantized at load
  like a dense layer's projections; or transformers 5's fused in-memory layout,
  `experts.gate_up_proj` [N, 2I, E] and `experts.down_proj` [N, E, I], read as float (a
  quantized load of it is refused in one line); the shared expert `shared_expert.*` and its gate
  `shared_expert_gate.weight` [1, E] where the family has them (MoeConfig.shared_size,
  shared_gate).
- Mixtral's names (its checkpoints', and what transformers 5 writes for it): the block is
  `block_sparse_moe.` instead of `mlp.`, its router `block_sparse_moe.gate.weight`, each expert's
  `experts.{e}.w1 / w3 / w2` (gate, up, down); taken wherever the layer has that router.
- DeepSeek's (deepseek_moe.py): the same router and experts, the ungated shared experts
  `shared_experts.*` (MoeConfig.shared_name), and V3's `gate.e_score_correction_bias` [N] (read as
  float32, MoeConfig.score_bias); the router read as float32 where MoeConfig.router_float32, both
  from the file's values whatever the load's dtype (transformers keeps them float32).
Every tensor named here is read; one left over refuses the load (loader.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..errors import ModelError
from ..models.family import DENSE
from ..models.moe_layer import MoeWeights

EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")  # an expert's gate, up and down projections
MIXTRAL_EXPERT_NAMES = ("w1", "w3", "w2")


@dataclass(frozen=True)
class Source:
    get: Callable  # name -> float tensor
    proj: Callable  # *names -> projection (rows of the names stacked), quantized where the load is
    has: Callable  # name -> bool
    quantized: str | None  # the load's quantization ("q8_0", "q4", ...), None: float
    # name -> float32 tensor whatever the load's dtype (what transformers keeps float32: DeepSeek's
    # router and correction bias, _keep_in_fp32_modules_strict); None: `get`, then widened
    get_float32: Callable | None = None


def mlp_weights(prefix: str, kind: str, config, source: Source) -> dict:
    if kind == DENSE:
        return dict(gate_up=source.proj(prefix + "gate_proj.weight", prefix + "up_proj.weight"),
                    down=source.proj(prefix + "down_proj.weight"), moe=None)
    cfg = config.moe
    names = EXPERT_NAMES
    mixtral = prefix.removesuffix("mlp.") + "block_sparse_moe."
    if source.has(mixtral + "gate.weight"):  # Mixtral's names
        prefix, names = mixtral, MIXTRAL_EXPERT_NAMES
    read32 = source.get_float32 or (lambda name: source.get(name).float())
    router = (read32 if cfg.router_float32 else source.get)(prefix + "gate.weight")  # [N, E]
    if tuple(router.shape) != (cfg.num_experts, config.hidden_size):
        raise ModelError(f"{prefix}gate.weight is {list(router.shape)}, not [num_experts {cfg.num_experts}, "
                         f"hidden_size {config.hidden_size}]")
    gate_up, down = _experts(prefix + "experts.", cfg, source, names)
    shared = {}
    if cfg.score_bias:
        bias = read32(prefix + "gate.e_score_correction_bias")  # [N] float32
        if tuple(bias.shape) != (cfg.num_experts,):
            raise ModelError(f"{prefix}gate.e_score_correction_bias is {list(bias.shape)}, not [n_routed_experts "
                             f"{cfg.num_experts}]")
        shared["score_bias"] = bias
    if cfg.shared_size:
        s = prefix + cfg.shared_name + "."
        shared.update(shared_gate_up=source.proj(s + "gate_proj.weight", s + "up_proj.weight"),
                      shared_down=source.proj(s + "down_proj.weight"),
                      shared_gate=source.get(prefix + "shared_expert_gate.weight") if cfg.shared_gate else None)
    return dict(gate_up=None, down=None, moe=MoeWeights(router, gate_up, down, **shared))


def _experts(prefix: str, cfg, source: Source, names: tuple = None) -> tuple[list, list]:
    """Each routed expert's [2I, E] and [E, I]: per-expert tensors (names: the gate's, the up's and
    the down's), or the fused layout's slices."""
    gate, up, down = names or EXPERT_NAMES
    if not source.has(prefix + "gate_up_proj"):
        gate_up = [source.proj(f"{prefix}{e}.{gate}.weight", f"{prefix}{e}.{up}.weight")
                   for e in range(cfg.num_experts)]
        return gate_up, [source.proj(f"{prefix}{e}.{down}.weight") for e in range(cfg.num_experts)]
    if source.quantized:
        raise ModelError(f"{prefix}gate_up_proj: experts in transformers' fused layout are read as float only; "
                         f"use --dtype float32, or save the model with per-expert tensors")
    fused_gate_up = source.get(prefix + "gate_up_proj")  # [N, 2I, E]
    fused_down = source.get(prefix + "down_proj")  # [N, E, I]
    if fused_gate_up.shape[0] != cfg.num_experts or fused_gate_up.shape[1] != 2 * cfg.expert_size:
        raise ModelError(f"{prefix}gate_up_proj is {list(fused_gate_up.shape)}, not [num_experts "
                         f"{cfg.num_experts}, 2 x moe_intermediate_size {cfg.expert_size}, hidden]")
    return list(fused_gate_up.unbind(0)), list(fused_down.unbind(0))
