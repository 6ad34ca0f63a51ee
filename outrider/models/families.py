"""Which architectures the runtime runs, and the switches that tell them apart.

One entry per family; `llama.py`, `mistral.py`, `qwen2.py`, `qwen3.py`, `qwen3_5.py`, `llama_hybrid.py`,
`qwen3_next.py`, `qwen2_moe.py`, `qwen3_moe.py`, `mixtral.py`, `olmoe.py`, `gemma3.py`, `deepseek_v2.py`, `deepseek_v3.py`, `minicpm3.py`, `mha2mla.py` and `idefics3.py` (a vision-language model's text side) each declare theirs. Adding a family that fits the layer kinds the decoder runs is one small file and
one line below, or a `register_family(FAMILY)` call from your own code (docs/adding-a-family.md).
"""

from __future__ import annotations

from ..errors import ModelError
from . import deepseek_v2, deepseek_v3, gemma3, idefics3, llama, llama_hybrid, mha2mla, minicpm3, mistral, mixtral, olmoe, qwen2, qwen2_moe, qwen3, qwen3_5, qwen3_moe, qwen3_next
from .family import Family


BUILT_IN = (llama.FAMILY, mistral.FAMILY, qwen2.FAMILY, qwen3.FAMILY, qwen3_5.FAMILY, llama_hybrid.FAMILY,
            qwen3_next.FAMILY, qwen2_moe.FAMILY, qwen3_moe.FAMILY, mixtral.FAMILY, olmoe.FAMILY, gemma3.FAMILY, deepseek_v2.FAMILY, deepseek_v3.FAMILY, minicpm3.FAMILY,
            mha2mla.FAMILY, idefics3.FAMILY)
_ADDED: list[Family] = []  # register_family's


def register_family(family: Family) -> None:
    """Run `family`'s architectures (a family of your own; replaces one of the same name)."""
    unregister_family(family.name)
    _ADDED.append(family)


def unregister_family(name: str) -> None:
    _ADDED[:] = [f for f in _ADDED if f.name != name]


def _registry() -> dict[str, Family]:
    table = {}
    for family in (*BUILT_IN, *_ADDED):
        for arch in family.architectures:
            table[arch] = family
    return table


def family_for(architecture: str, source: str = "config.json") -> Family:
    table = _registry()
    if architecture not in table:
        known = ", ".join(sorted(table))
        raise ModelError(f"{source}: architecture '{architecture}' is not supported (supported: {known})")
    return table[architecture]
