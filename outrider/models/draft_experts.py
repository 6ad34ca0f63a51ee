"""DraftExpert's draft (seed method #26, card 2.26): the target's own layers, each MoE layer routing
its top-1 expert, plus the shared expert and one small trained *draft expert* a layer.

    experts = DraftExperts.load(path)                     # the trained draft experts (safetensors)
    config, layers = draft_layers(target, experts, watch) # the target's layers as the draft runs them
    draft_mlp_reference(w, cfg, experts, layer, x)        # the slow reference of one draft MoE layer

Per MoE layer l the draft computes, for a row x (its config's top_k set to 1):

    out(x) = w1(x) * SwiGLU_e1(x) + g(x) * (SwiGLU_shared(x) + SwiGLU_draft_l(x))

e1 the router's best expert and w1 its weight as the target weighs it (renormalised to 1 where the
target renormalises), g(x) = sigmoid(x . shared_gate) where the target gates its shared expert
(Qwen), else 1. The shared and the draft expert under one gate are ONE SwiGLU of the concatenated
neurons (gate_up [gate_s; gate_d; up_s; up_d], down [down_s | down_d]), so the draft runs through
moe_layer.moe_mlp unchanged: the layer's MoeWeights with that shared expert and a watched router.
A target without a shared expert (Qwen3-MoE, Mixtral, OLMoE) gets the draft expert alone as an
ungated shared expert. `draft_mlp_reference` adds the terms one by one (tests hold the fast path
to it). train/draftexpert_train.py fits the draft experts: g(x) * SwiGLU_draft(x) regressed on
what the target's other routed experts add (its MoE output minus the draft's without them).

RouterWatch: the router's weight [N, E] as an object `layers.linear` multiplies through
(`.linear(x)`), handing every product's input rows [M, E] and logits [M, N] to a callback with the
layer's index (which may hand back logits to route by instead): how the drafter reads the draft's routing (to predict which target experts a
verify will need: prefetch hints and expert-expansion truncation) and how training reads the MoE
layers' inputs, with no change to the MoE layer.

The file: `draft_experts.{l}.gate_up` [2 I_d, E] and `draft_experts.{l}.down` [E, I_d] for each MoE
layer l of the target, `fingerprint.router` (the first MoE layer's router [N, E], to refuse a draft
trained on another model), and the metadata `hidden_size`, `num_layers`, `num_experts`, `base`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import ModelError
from .layers import linear, swiglu_mlp
from .moe_config import MoeConfig
from .moe_layer import MoeWeights, moe_mlp

SHIPPED = Path(__file__).parent / "shipped"  # draftexpert-<name>/draft_experts.safetensors


@dataclass
class DraftExperts:
    gate_up: dict[int, torch.Tensor]  # MoE layer index -> [2 I_d, E] float32 (gate rows, then up rows)
    down: dict[int, torch.Tensor]  # MoE layer index -> [E, I_d]
    router: torch.Tensor  # [N, E]: the first MoE layer's router of the target they were trained on
    meta: dict

    @property
    def size(self) -> int:
        """I_d, the draft expert's neurons."""
        return next(iter(self.down.values())).shape[1]

    @staticmethod
    def load(path) -> "DraftExperts":
        path = Path(path)
        if not path.is_file():
            raise ModelError(f"no draft-expert file at {path}")
        gate_up, down = {}, {}
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            for name in f.keys():
                if name.startswith("draft_experts."):
                    _, layer, part = name.split(".")
                    (gate_up if part == "gate_up" else down)[int(layer)] = f.get_tensor(name).float()
            if "fingerprint.router" not in f.keys() or not gate_up or set(gate_up) != set(down):
                raise ModelError(f"{path} is not a draft-expert file (draft_experts.L.gate_up / down and "
                                 "fingerprint.router expected)")
            router = f.get_tensor("fingerprint.router").float()
        return DraftExperts(gate_up, down, router, meta)

    def save(self, path, dtype: torch.dtype = torch.float16) -> None:
        """Weights stored in `dtype` (float16 by default: half the bytes; the draft computes in float32)."""
        tensors = {f"draft_experts.{l}.gate_up": t.to(dtype).contiguous() for l, t in self.gate_up.items()}
        tensors |= {f"draft_experts.{l}.down": t.to(dtype).contiguous() for l, t in self.down.items()}
        tensors["fingerprint.router"] = self.router.float().contiguous()
        save_file(tensors, str(path), metadata={k: v if isinstance(v, str) else json.dumps(v)
                                                for k, v in self.meta.items()})

    def check_fits(self, target) -> None:
        """One-line ModelError unless these draft experts were trained on `target` (a Decoder)."""
        moe = moe_layers(target)
        c = target.config
        if sorted(self.gate_up) != moe:
            raise ModelError(f"the draft experts are for MoE layers {sorted(self.gate_up)}, the target's are {moe}")
        if next(iter(self.gate_up.values())).shape[1] != c.hidden_size:
            raise ModelError(f"the draft experts take hidden size {next(iter(self.gate_up.values())).shape[1]}, "
                             f"the target's is {c.hidden_size}")
        router = target.layers[moe[0]].moe.router
        if router.shape != self.router.shape or not torch.allclose(router.float(), self.router, atol=1e-3, rtol=1e-2):
            raise ModelError("these draft experts were trained on another model (its router differs from the "
                             "target's); train them for this one (python -m outrider.train.draftexpert_train)")


def moe_layers(target) -> list[int]:
    """The indices of the target's MoE layers."""
    return [i for i, w in enumerate(target.layers) if w.moe is not None]


class RouterWatch:
    """A router weight [N, E] whose products layers.linear routes through `.linear`, reporting
    (layer, x [M, E], logits [M, N]) to `sink` each time."""

    def __init__(self, weight: torch.Tensor, layer: int, sink):
        self.weight, self.layer, self.sink = weight, layer, sink

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def float(self) -> "RouterWatch":
        return self if self.weight.dtype == torch.float32 else RouterWatch(self.weight.float(), self.layer, self.sink)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, E] -> logits [M, N]; a sink that returns a tensor replaces them (a draft's routing
        restricted to resident experts: logits of the others -inf)."""
        logits = linear(x, self.weight, bias)  # [M, N]
        out = self.sink(self.layer, x, logits)
        return logits if out is None else out


def with_draft_expert(w: MoeWeights, gate_up: torch.Tensor, down: torch.Tensor) -> MoeWeights:
    """w with its shared expert followed by the draft expert's neurons (one SwiGLU under the shared
    gate), or the draft expert alone where w has no shared expert."""
    if w.shared_gate_up is None:
        return replace(w, shared_gate_up=gate_up, shared_down=down, shared_gate=None)
    if not isinstance(w.shared_gate_up, torch.Tensor) or not isinstance(w.shared_down, torch.Tensor):
        raise ModelError("DraftExpert needs the shared expert in float weights (load the target unquantized)")
    dtype = w.shared_gate_up.dtype
    g_s, u_s = w.shared_gate_up.chunk(2)  # [I_s, E] each
    g_d, u_d = gate_up.to(dtype).chunk(2)  # [I_d, E] each
    return replace(w, shared_gate_up=torch.cat([g_s, g_d, u_s, u_d]),  # [2 (I_s + I_d), E]
                   shared_down=torch.cat([w.shared_down, down.to(dtype)], dim=1))  # [E, I_s + I_d]


class DraftLayers:
    """The target's layers as the draft runs them, the merged shared experts made once and the
    routed experts taken from the target's layers at each call (so an expert store attached
    to the target later serves the draft too)."""

    def __init__(self, experts: DraftExperts):
        self.experts = experts
        self._merged: dict[int, tuple] = {}  # layer -> (shared_gate_up, shared_down, shared_gate, of)

    def config(self, target_config):
        """The target's config with top-1 routing."""
        return replace(target_config, moe=replace(target_config.moe, top_k=1))

    def layers(self, target, sink=None) -> list:
        out = []
        for i, w in enumerate(target.layers):
            if w.moe is None:
                out.append(w)
                continue
            merged = self._merged.get(i)
            if merged is None or merged[3] is not w.moe.shared_gate_up:
                m = with_draft_expert(w.moe, self.experts.gate_up[i], self.experts.down[i])
                merged = self._merged[i] = (m.shared_gate_up, m.shared_down, m.shared_gate, w.moe.shared_gate_up)
            router = w.moe.router
            while isinstance(router, RouterWatch):  # a bench's watch on the target's router: the weight
                router = router.weight
            router = router if sink is None else RouterWatch(router, i, sink)
            out.append(replace(w, moe=replace(w.moe, router=router, shared_gate_up=merged[0],
                                              shared_down=merged[1], shared_gate=merged[2])))
        return out


def draft_mlp_reference(w: MoeWeights, cfg: MoeConfig, experts: DraftExperts, layer: int,
                        x: torch.Tensor) -> torch.Tensor:
    """The slow reference of a draft MoE layer: x [M, E] -> [M, E], the terms of the module's
    formula added one by one (the top-1 expert, the shared expert gated, the draft expert gated)."""
    routed = moe_mlp(replace(w, shared_gate_up=None, shared_down=None, shared_gate=None), replace(cfg, top_k=1), x)
    gate = 1.0
    if w.shared_gate is not None:
        gate = torch.sigmoid(linear(x, w.shared_gate))  # [M, 1]
    shared = 0.0 if w.shared_gate_up is None else swiglu_mlp(x, w.shared_gate_up, w.shared_down)
    draft = swiglu_mlp(x, experts.gate_up[layer].to(x.dtype), experts.down[layer].to(x.dtype))  # [M, E]
    return routed + gate * (shared + draft)


def shipped(name: str) -> Path:
    """The shipped draft experts called `name` (draftexpert-<name>/draft_experts.safetensors)."""
    return SHIPPED / f"draftexpert-{name}" / "draft_experts.safetensors"


def shipped_names() -> list[str]:
    return sorted(p.parent.name.removeprefix("draftexpert-") for p in SHIPPED.glob("draftexpert-*/draft_experts.safetensors"))
