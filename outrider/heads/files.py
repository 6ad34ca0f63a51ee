"""A head folder's files, for every head kind: `config.json` read as a dict, `model.safetensors`
opened and read tensor by tensor (safetensors only, never pickles), and the config fields' JSON
types checked; every problem a one-line ModelError naming the file and saying what to do."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..errors import ModelError

WEIGHTS = "model.safetensors"


def read_raw(folder: str | Path, what: str = "an EAGLE-3 head") -> dict:
    """The head's config.json as a dict (ModelError when absent or not JSON)."""
    path = Path(folder) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelError(f"{path} not found: {what} is a folder with config.json and {WEIGHTS}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ModelError(f"{path} is not valid JSON ({err}); re-export the head") from None
    if not isinstance(raw, dict):
        raise ModelError(f"{path} holds no JSON object; re-export the head")
    return raw


def open_weights(folder: Path, what: str = "an EAGLE-3 head"):
    """The folder's model.safetensors, opened (a one-line ModelError when missing or corrupt)."""
    path = folder / WEIGHTS
    if not path.exists():
        raise ModelError(f"{path} not found: {what} is a folder with config.json and {WEIGHTS} "
                         "(safetensors only, never pickles)")
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError, ValueError) as err:
        raise ModelError(f"{path} is corrupt or truncated ({err}); re-export the head") from None


def read_weight(tensors, folder: Path, name: str) -> torch.Tensor:
    """Tensor `name` of an opened weights file (a one-line ModelError when unreadable)."""
    try:
        return tensors.get_tensor(name)
    except (SafetensorError, OSError) as err:
        raise ModelError(f"{folder / WEIGHTS}: cannot read '{name}' ({err}); re-export the head") from None


def json_is(value, kind: str) -> bool:
    for k in kind.split("|"):
        if k == "None" and value is None:
            return True
        if k == "str" and isinstance(value, str):
            return True
        if k == "bool" and isinstance(value, bool):
            return True
        if k == "int" and isinstance(value, int) and not isinstance(value, bool):
            return True
        if k == "float" and isinstance(value, (int, float)) and not isinstance(value, bool):
            return True
        if k == "dict" and isinstance(value, dict):
            return True
        if k.startswith("list[") and isinstance(value, list) and all(json_is(v, k[5:-1]) for v in value):
            return True
    return False


def field_problems(raw: dict, fields, where: str = "") -> list[str]:
    """Missing required fields and fields of the wrong JSON type, one phrase each."""
    problems = []
    for name, kind, required in fields:
        if name not in raw:
            if required:
                problems.append(f"{where}{name} is missing")
        elif not json_is(raw[name], kind):
            problems.append(f"{where}{name} should be {kind}, got {raw[name]!r}")
    return problems
