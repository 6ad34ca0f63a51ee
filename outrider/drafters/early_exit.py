"""`--drafter early-exit:K`: self-speculation, the target's own first K layers draft.

No second model: the drafter runs the target's `Decoder` with `num_layers=K` (`ModelDrafter`,
model.py), then the target's final norm and lm_head, over the target's own K/V cache: the
committed prefix's first-K-layer K/V the target already wrote is exactly what the drafter would
compute, so nothing is prefilled twice. K must be below the target's layer count; about a
quarter of the layers is a good start.
"""

from __future__ import annotations

from pathlib import Path

from dataclasses import replace

from ..errors import ConfigError
from .model import ModelDrafter
from .registry import DrafterEntry, register


def parse_argument(text: str) -> int:
    try:
        k = int(text)
    except ValueError:
        k = 0
    if k < 1:
        raise ConfigError("early-exit:K needs a layer count K >= 1")
    return k


def check_fits(k: int, target_config, target_path: Path) -> str | None:
    if k >= target_config.num_layers:
        return (f"the target has {target_config.num_layers} layers, so early-exit:K needs K below that "
                "(about a quarter is a good start)")
    return None


def build(k: int, shape, target, target_path: Path) -> ModelDrafter:
    # over the target's own K/V cache; a gated-delta target's state holds the verify's rows until the
    # commit, so the drafter keeps a state of its own there (its first K layers, prefilled once more)
    shared = target.config.delta is None
    return ModelDrafter(target, shape, num_layers=k, name=f"early-exit:{k}", share_target_cache=shared)


register(DrafterEntry("early-exit", "early-exit:K", replace(ModelDrafter.capabilities, reads_target_cache=True),
                      build=build,
                      parse_argument=parse_argument, check_fits=check_fits))
