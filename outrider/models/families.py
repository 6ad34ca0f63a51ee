"""Which architectures the runtime runs, and the switches that tell them apart.

One entry per family; `llama.py`, `qwen2.py` and `qwen3.py` each declare theirs. Adding a family
that fits the shared decoder is one small file and one line below.
"""

from __future__ import annotations

from ..errors import ModelError
from . import llama, qwen2, qwen3, qwen3_5
from .family import Family


def _registry() -> dict[str, Family]:
    table = {}
    for family in (llama.FAMILY, qwen2.FAMILY, qwen3.FAMILY, qwen3_5.FAMILY):
        for arch in family.architectures:
            table[arch] = family
    return table


def family_for(architecture: str, source: str = "config.json") -> Family:
    table = _registry()
    if architecture not in table:
        known = ", ".join(sorted(table))
        raise ModelError(f"{source}: architecture '{architecture}' is not supported (supported: {known})")
    return table[architecture]
