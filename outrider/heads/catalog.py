"""Heads shipped with the package, found by their kind and their target's catalog name.

A shipped head of every kind (heads/kinds.py) lives in `outrider/heads/shipped/<kind>/<target-catalog-name>/`
(config.json, model.safetensors, outrider_golden.json, train_info.json), so `--drafter eagle3:NAME` /
`dflash:NAME` and `outrider export eagle3|dflash NAME` reach it by the name of the model it drafts for:

    resolve_head("smollm2-135m-instruct")             # -> .../heads/shipped/eagle3/smollm2-135m-instruct
    resolve_head("smollm2-135m-instruct", "dflash")   # -> .../heads/shipped/dflash/smollm2-135m-instruct
    resolve_head("./my-head")                         # a folder: itself, whatever its name
    drafters_for("smollm2-135m-instruct")   # -> ["eagle3:smollm2-135m-instruct", "dflash:..."] (models list)

A folder that exists wins over a shipped name; text that looks like a path (a separator, ".",
"~") is always taken as a path, so a mistyped folder still gets the loader's "config.json not
found". `SHIPPED_DIR` is read at each call (tests point it elsewhere).
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import ConfigError
from .kinds import KINDS

SHIPPED_DIR = Path(__file__).parent / "shipped"


def shipped_heads(kind: str = "eagle3") -> dict[str, Path]:
    """Target catalog name -> the folder of its shipped head of `kind` (those with a config.json)."""
    root = Path(SHIPPED_DIR) / kind
    if not root.is_dir():
        return {}
    return {p.name: p for p in sorted(root.iterdir()) if p.is_dir() and (p / "config.json").is_file()}


def drafters_for(target_name: str) -> list[str]:
    """The `--drafter` values that name a shipped head for the target `target_name`."""
    return [f"{kind}:{target_name}" for kind in KINDS if target_name in shipped_heads(kind)]


def looks_like_path(text: str) -> bool:
    return os.sep in text or "/" in text or text.startswith((".", "~"))


def resolve_head(text: str, kind: str = "eagle3") -> Path:
    """A head folder (if `text` names one, or looks like a path) or the folder of a shipped head
    of `kind`; a one-line ConfigError listing the shipped heads otherwise."""
    path = Path(text).expanduser()
    if path.is_dir() or looks_like_path(text):
        return path
    shipped = shipped_heads(kind)
    if text in shipped:
        return shipped[text]
    known = ", ".join(shipped) or "none in this installation"
    raise ConfigError(f"no head folder '{text}' and no shipped {KINDS[kind].title} head of that name; give a head folder "
                      f"(config.json + model.safetensors) or a shipped head: {known}")
