"""Training checkpoints: safetensors and JSON only (never pickles), written atomically.

    OUT/checkpoint/state.safetensors   model.<EAGLE name> (the head's state_tensors, d2t/t2d included)
                                       optim.<param index>.<key> (AdamW's exp_avg, exp_avg_sq, step)
    OUT/checkpoint/state.json          step, tokens seen, data position, elapsed s, seed, the
                                       arguments, the head config, AdamW's param_groups

Each file is written under a temporary name and renamed into place; state.json goes last and
names the safetensors' sha256, so a crash between the two leaves the previous checkpoint
readable, or a mismatch that `load` refuses in one line.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..errors import ConfigError

FOLDER, TENSORS, META = "checkpoint", "state.safetensors", "state.json"


@dataclass
class Checkpoint:
    meta: dict  # state.json
    model: dict[str, torch.Tensor]  # the head's state_tensors
    optim: dict  # an AdamW state_dict (tensors from the safetensors, param_groups from the JSON)


def exists(out: Path) -> bool:
    return (Path(out) / FOLDER / META).is_file()


def save(out: Path, meta: dict, model_tensors: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer) -> Path:
    folder = Path(out) / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    state = optimizer.state_dict()
    tensors = {f"model.{k}": v.detach().cpu().contiguous() for k, v in model_tensors.items()}
    for index, slots in state["state"].items():
        for key, value in slots.items():
            value = value if isinstance(value, torch.Tensor) else torch.tensor(value)
            tensors[f"optim.{index}.{key}"] = value.detach().cpu().contiguous()
    tmp = folder / (TENSORS + ".tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, folder / TENSORS)
    meta = dict(meta, param_groups=state["param_groups"], tensors_sha256=_sha256(folder / TENSORS))
    tmp = folder / (META + ".tmp")
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, folder / META)
    return folder


def load(out: Path) -> Checkpoint:
    folder = Path(out) / FOLDER
    try:
        meta = json.loads((folder / META).read_text())
    except FileNotFoundError:
        raise ConfigError(f"--resume: {folder / META} not found; run without --resume to start") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"--resume: {folder / META} is corrupt ({err}); delete {folder} to start again") from None
    path = folder / TENSORS
    if not path.is_file() or _sha256(path) != meta.get("tensors_sha256"):
        raise ConfigError(f"--resume: {path} is missing or does not match {META} (an interrupted write?); "
                          f"delete {folder} to start again")
    tensors = load_file(str(path))
    model = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
    states: dict[int, dict] = {}
    for key, value in tensors.items():
        if key.startswith("optim."):
            _, index, name = key.split(".", 2)
            states.setdefault(int(index), {})[name] = value
    return Checkpoint(meta, model, {"state": states, "param_groups": meta["param_groups"]})


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
