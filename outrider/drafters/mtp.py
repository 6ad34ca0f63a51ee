"""`--drafter mtp:PATH_OR_NAME`: a multi-token-prediction head (heads/mtp/head.py) drafts from the target's last hidden state.

PATH is a head folder in DeepSeek-V3's MTP layout (heads/mtp/format.py); NAME a head shipped for
that target (heads/catalog.py, shipped/mtp/<target>/). The module is reused autoregressively for
every draft step, fed its own output hidden, as vLLM's `mtp` method and llama.cpp's draft-mtp
run one module: the same row alignment and feeding as an EAGLE-3 head, so the drafter is
drafters/eagle3.py's (its K/V cache, catch-up, pending features, and every tree shape through
model_growers.py), over this head. It declares the target's last layer as `needs_hidden`, so the
verify forward returns it at no extra pass.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError
from ..spec.shapes import TreeShape
from .capabilities import Capabilities
from .eagle3 import TREES, Eagle3Drafter
from .registry import DrafterEntry, register

USAGE = "mtp:PATH_OR_NAME"


def parse_argument(text: str) -> str:
    from ..heads.catalog import resolve_head

    if not text:
        raise ConfigError("mtp:PATH needs the folder of an MTP head (config.json + model.safetensors) "
                          "or the name of a shipped head")
    return str(resolve_head(text, kind="mtp"))


def check_fits(argument: str, target_config, target_path: Path) -> str | None:
    from ..heads.mtp.format import misfit, read_config

    return misfit(read_config(argument), target_config)


def build(argument: str, shape: TreeShape, target, target_path: Path) -> Eagle3Drafter:
    from ..heads.mtp.format import load_mtp

    head = load_mtp(argument, target)
    return Eagle3Drafter(head, shape, head.config.taps(target.config.num_layers), name=f"mtp:{argument}")


register(DrafterEntry("mtp", USAGE, Capabilities(trees=TREES, couples=True), build=build,
                      parse_argument=parse_argument, check_fits=check_fits))
