"""What tells one decoder family from another: a few switches read from its config.json."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]
    qkv_bias: Callable[[dict], bool]  # from the raw config.json
    qk_norm: bool  # RMS norm on each head's queries and keys before rotary
