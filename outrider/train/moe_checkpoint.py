"""Write a dense Llama / Qwen2 checkpoint's FFNs as a mixture of experts in the Qwen2-MoE layout
(Qwen2MoeForCausalLM, which transformers loads), given a split: which intermediate neurons each
expert holds and a router (train/moe_split.py finds both).

    tensors = moe_tensors(dense, raw, split)      # Hugging Face names -> tensors
    config = moe_config(raw, split, top_k)        # the Qwen2-MoE config.json

Why Qwen2-MoE and not Qwen3-MoE: Qwen3's attention always RMS-norms each head's queries and keys,
which a Llama or Qwen2 attention does not; Qwen2-MoE's attention is Qwen2's (qkv_bias a switch), so
SmolLM2 (no biases) and Qwen2.5 (q/k/v biases) keep their attention bit for bit.

The experts (E of them, each of I/E neurons; layer l's neurons split.perm[l] in expert order):
    expert e's gate_proj, up_proj = the dense gate_proj, up_proj rows of its neurons   [I/E, H]
    expert e's down_proj          = E * the dense down_proj columns of its neurons     [H, I/E]
    mlp.gate (the router)         = split.router[l]                                    [E, H]
    norm_topk_prob false
    the shared expert (optional, S neurons: those of the largest contribution, always active)
                                  = its neurons' gate/up rows and 2 * their down columns, its gate
                                    shared_expert_gate zero: sigmoid(0) = 0.5 exactly, so 0.5 * 2 = 1

so the block's output is sum over the chosen experts of (E * p_e(x)) * expert_e(x), p the router's
softmax over all E. The router's logits are fitted and then shrunk (moe_split.py: spread ~1e-3 per
token), so E * p_e = 1 + O(1e-3): the chosen experts' outputs are summed with weights within about
1e-3 of 1, and the choice (topk of p, a monotone function of the logits) is the fitted router's.
With every expert active the block is the dense FFN up to those weights and float summation order
(not bit-exact: Qwen2-MoE multiplies each expert's output by its softmax weight, and no fitted
softmax router gives every expert a weight of exactly 1/E; with the router zeroed it does, for E a
power of two, and then only the summation order differs). docs/models.md states the figures.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ConfigError

ARCHITECTURE = "Qwen2MoeForCausalLM"
DENSE_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")


@dataclass
class Split:
    perm: torch.Tensor  # [L, I] long: layer l's neurons, the shared expert's S, then expert 0's (I-S)/E, ...
    router: torch.Tensor  # [L, E, H] float32: the router's weights (logits = x . router[l, e])
    shared: int = 0  # S: perm[l, :S] are the shared expert's neurons, the experts' follow

    @property
    def experts(self) -> int:
        return self.router.shape[1]


def check_dense(raw: dict, experts: int, shared: int = 0) -> None:
    """Refuse, in one line, a config this split cannot write."""
    arch = (raw.get("architectures") or ["?"])[0]
    if arch not in DENSE_ARCHITECTURES:
        raise ConfigError(f"{arch} cannot be split into experts (supported: {', '.join(DENSE_ARCHITECTURES)})")
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act {raw.get('hidden_act')} is not SwiGLU's silu")
    if arch == "LlamaForCausalLM" and (raw.get("attention_bias") or raw.get("mlp_bias")):
        raise ConfigError("a Llama with attention or MLP biases has no Qwen2-MoE form (o_proj has no bias there)")
    inter = int(raw["intermediate_size"])
    if experts < 1 or not 0 <= shared < inter or (inter - shared) % experts:
        raise ConfigError(f"{experts} experts do not divide intermediate_size {inter} less {shared} shared neurons evenly")


def moe_config(raw: dict, experts: int, top_k: int, shared: int = 0) -> dict:
    """The Qwen2-MoE config.json of the dense config `raw` split into `experts` experts and a shared
    expert of `shared` neurons."""
    check_dense(raw, experts, shared)
    qwen2 = raw["architectures"][0] == "Qwen2ForCausalLM"
    keep = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "rms_norm_eps", "rope_theta", "rope_parameters", "max_position_embeddings",
            "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "attention_dropout")
    cfg = {k: raw[k] for k in keep if k in raw}
    cfg.update({
        "architectures": [ARCHITECTURE], "model_type": "qwen2_moe", "hidden_act": "silu",
        "intermediate_size": int(raw["intermediate_size"]),  # the dense MLP's (no layer uses it: mlp_only_layers [])
        "moe_intermediate_size": (int(raw["intermediate_size"]) - shared) // experts,
        "num_experts": experts, "num_experts_per_tok": top_k, "norm_topk_prob": False,
        "shared_expert_intermediate_size": shared, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "qkv_bias": qwen2,
        "use_sliding_window": False, "output_router_logits": False, "router_aux_loss_coef": 0.0,
        "use_cache": True, "dtype": "float32",
    })
    return cfg


def moe_tensors(dense: dict[str, torch.Tensor], raw: dict, split: Split) -> dict[str, torch.Tensor]:
    """The dense model's tensors (Hugging Face names) with each layer's MLP written as split's experts."""
    E, S = split.experts, split.shared
    check_dense(raw, E, S)
    L, H, inter = int(raw["num_hidden_layers"]), int(raw["hidden_size"]), int(raw["intermediate_size"])
    if tuple(split.perm.shape) != (L, inter) or tuple(split.router.shape) != (L, E, H):
        raise ConfigError(f"the split's shapes {tuple(split.perm.shape)}, {tuple(split.router.shape)} do not fit "
                          f"{L} layers of intermediate size {inter} and hidden size {H}")
    n = (inter - S) // E
    out = {k: v for k, v in dense.items() if ".mlp." not in k}
    for l in range(L):
        p = f"model.layers.{l}.mlp."
        gate, up, down = dense[p + "gate_proj.weight"], dense[p + "up_proj.weight"], dense[p + "down_proj.weight"]
        if sorted(split.perm[l].tolist()) != list(range(inter)):
            raise ConfigError(f"layer {l}'s split is not a permutation of its {inter} neurons")
        for e in range(E):
            idx = split.perm[l, S + e * n:S + (e + 1) * n]  # [n] expert e's neurons
            q = f"{p}experts.{e}."
            out[q + "gate_proj.weight"] = gate.index_select(0, idx).contiguous()  # [n, H]
            out[q + "up_proj.weight"] = up.index_select(0, idx).contiguous()  # [n, H]
            out[q + "down_proj.weight"] = (down.index_select(1, idx) * E).contiguous()  # [H, n]
        out[p + "gate.weight"] = split.router[l].to(gate.dtype).contiguous()  # [E, H]
        idx = split.perm[l, :S]  # [S] the shared expert's neurons (S may be 0: an output of exactly 0)
        out[p + "shared_expert.gate_proj.weight"] = gate.index_select(0, idx).contiguous()  # [S, H]
        out[p + "shared_expert.up_proj.weight"] = up.index_select(0, idx).contiguous()  # [S, H]
        out[p + "shared_expert.down_proj.weight"] = (down.index_select(1, idx) * 2).contiguous()  # [H, S]
        out[p + "shared_expert_gate.weight"] = gate.new_zeros(1, H)  # sigmoid(0) = 0.5 exactly, times the 2 above
    return out
