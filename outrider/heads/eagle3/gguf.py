"""The EAGLE-3 head as llama.cpp loads it (`--spec-type draft-eagle3`; arch "eagle3"): its tensor
names, required keys and tensors, and its metadata (the facts and their llama.cpp lines:
heads/gguf_layout.py's docstring). Its graph ropes in NORM mode, so q/k rows are stored permuted."""

from __future__ import annotations

from pathlib import Path

import torch

from ...errors import ModelError
from ..gguf_layout import LAYER, TOP

ARCH = "eagle3"
NAMES_LAYER = {**LAYER, "hidden_norm.weight": "attn_norm_2.weight"}
NAMES_TOP = TOP
REQUIRED_KEYS = ("context_length", "embedding_length", "block_count", "attention.layer_norm_rms_epsilon",
                 "target_layers", "target_hidden_size")


def layer_of(ours: str) -> tuple[int, str] | None:
    """(layer index, name within the layer) of our layer tensor (`midlayer.`), else None."""
    return (0, ours[len("midlayer."):]) if ours.startswith("midlayer.") else None


def permuted_heads(ours: str, num_heads: int, num_kv_heads: int) -> int | None:
    """q and k rows go RoPE-permuted by their head counts (NORM rope), nothing else."""
    if ours.endswith("self_attn.q_proj.weight"):
        return num_heads
    if ours.endswith("self_attn.k_proj.weight"):
        return num_kv_heads
    return None


def required_layer(prefix: str, hidden: int, head_dim: int) -> dict[str, tuple[int, ...]]:
    """The kind's own required tensors of one layer, beyond the common ones."""
    return {prefix + "attn_norm_2.weight": (hidden,)}


def attention_inputs(hidden: int) -> int:
    return 2 * hidden  # q/k/v read [embedding ; hidden]


def num_layers(config) -> int:
    return 1


def head_tensors(source: str | Path, target_config, dtype: torch.dtype | None):
    """(config, {our name: tensor}) of the head in folder `source`, checked against the target."""
    from .export import disk_tensors, from_folder
    from .format import misfit

    head = from_folder(source)
    reason = misfit(head.config, target_config, "embed_tokens.weight" in head.tensors, "lm_head.weight" in head.tensors)
    if reason:
        raise ModelError(f"the head does not fit the target: {reason}")
    return head.config, disk_tensors(head, "eagle", dtype)


def metadata(config) -> dict:
    """The kind's own keys (without the `ARCH.` prefix)."""
    return {"target_hidden_size": config.target_hidden_size,
            "norm_before_residual": bool(config.norm_before_residual), "norm_before_fc": False}


def extra(writer, config) -> None:
    """Nothing beyond the keys and tensors."""
