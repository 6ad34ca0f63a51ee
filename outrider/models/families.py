"""Which architectures the runtime runs, and the switches that tell them apart.

One entry per family; `llama.py`, `qwen2.py` and `qwen3.py` each declare theirs. Adding a family
that fits the shared decoder is one small file and one line below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..errors import ModelError


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]
    qkv_bias: Callable[[dict], bool]  # from the raw config.json
    qk_norm: bool  # RMS norm on each head's queries and keys before rotary


def _registry() -> dict[str, Family]:
    from . import llama, qwen2, qwen3

    table = {}
    for family in (llama.FAMILY, qwen2.FAMILY, qwen3.FAMILY):
        for arch in family.architectures:
            table[arch] = family
    return table


def family_for(architecture: str, source: str = "config.json") -> Family:
    table = _registry()
    if architecture not in table:
        known = ", ".join(sorted(table))
        raise ModelError(f"{source}: architecture '{architecture}' is not supported (supported: {known})")
    return table[architecture]
