"""What tells one decoder family from another: a few switches read from its config.json, and the
kind of each layer's token mixer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

ATTENTION, GATED_DELTA = "attention", "gated_delta"  # the layer kinds (models/decoder.py runs each)


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]
    qkv_bias: Callable[[dict], bool]  # from the raw config.json
    qk_norm: bool  # RMS norm on each head's queries and keys before rotary
    # each layer's mixer kind from the raw config (default: attention everywhere)
    layer_kinds: Callable[[dict], tuple[str, ...]] = lambda raw: (ATTENTION,) * int(raw["num_hidden_layers"])
    attn_output_gate: bool = False  # attention's output times sigmoid of a second half of q_proj (Qwen3.5)
    norm_plus_one: bool = False  # RMS norms scale by (1 + weight) (zero-centred weights, Qwen3.5)
    reads: frozenset = field(default_factory=frozenset)  # checked config fields it implements (config_fields.py)
