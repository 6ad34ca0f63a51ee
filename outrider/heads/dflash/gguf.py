"""The DFlash head as llama.cpp loads it (`--spec-type draft-dflash`; arch "dflash"): its tensor
names, required keys and tensors, and its metadata (the facts and their llama.cpp lines:
heads/gguf_layout.py's docstring). Its graph ropes NEOX, so weights go as Hugging Face stores them;
the mask token goes with the tokenizer."""

from __future__ import annotations

from pathlib import Path

import torch

from ...errors import ModelError
from ..gguf_layout import LAYER, TOP

ARCH = "dflash"
NAMES_LAYER = {**LAYER, "self_attn.q_norm.weight": "attn_q_norm.weight",
               "self_attn.k_norm.weight": "attn_k_norm.weight"}
NAMES_TOP = {**TOP, "hidden_norm.weight": "enc.output_norm.weight"}
REQUIRED_KEYS = ("context_length", "embedding_length", "block_count", "attention.layer_norm_rms_epsilon",
                 "target_layers")


def layer_of(ours: str) -> tuple[int, str] | None:
    """(layer index, name within the layer) of our layer tensor (`layers.L.`), else None."""
    if not ours.startswith("layers."):
        return None
    index, _, rest = ours[len("layers."):].partition(".")
    return int(index), rest


def permuted_heads(ours: str, num_heads: int, num_kv_heads: int) -> int | None:
    return None  # NEOX rope: as Hugging Face stores them


def required_layer(prefix: str, hidden: int, head_dim: int) -> dict[str, tuple[int, ...]]:
    """The kind's own required tensors of one layer, beyond the common ones."""
    return {prefix + "attn_q_norm.weight": (head_dim,), prefix + "attn_k_norm.weight": (head_dim,)}


def attention_inputs(hidden: int) -> int:
    return hidden


def num_layers(config) -> int:
    return config.num_layers


def head_tensors(source: str | Path, target_config, dtype: torch.dtype | None):
    """(config, {our name: tensor}) of the head in folder `source`: every tensor its config implies,
    checked against it and against the target."""
    from .format import expected_shapes, misfit, read_config, read_tensors

    config = read_config(source)
    reason = misfit(config, target_config)
    if reason:
        raise ModelError(f"the head does not fit the target: {reason}")
    stored = read_tensors(source)
    required, optional = expected_shapes(config, target_config.num_layers)
    tensors = {}
    for name in [*required, *(n for n in optional if n in stored)]:
        if name not in stored:
            raise ModelError(f"the head lacks tensor {name}; it cannot be exported: re-train it")
        t, shape = stored[name], required.get(name, optional.get(name))
        if tuple(t.shape) != shape:
            raise ModelError(f"the head's tensor {name} has shape {list(t.shape)} but its config says "
                             f"{list(shape)}: fix the head before exporting it")
        tensors[name] = t if name in ("d2t", "t2d") or dtype is None else t.to(dtype)
    return config, tensors


def metadata(config) -> dict:
    """The kind's own keys (without the `ARCH.` prefix)."""
    return {"block_size": config.block_size}


def extra(writer, config) -> None:
    writer.add_mask_token_id(config.mask_token_id)  # the draft vocabulary's mask id (speculative.cpp l.997)
