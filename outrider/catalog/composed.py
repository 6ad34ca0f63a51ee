"""Models made of a pulled catalog model and layers shipped inside the package: a base's tensors,
minus those of the layers replaced, plus the shipped ones, in a folder of their own.

    COMPOSED["smollm2-135m-gdn"]           # base "smollm2-135m-instruct" + models/shipped/smollm2-135m-gdn
    compose(base_folder, shipped, folder)  # writes the folder (config.json, model.safetensors, tokenizer)
    pull("smollm2-135m-gdn")               # catalog/pull.py calls pull_composed: the base pulled, then composed

The shipped folder holds `hybrid.json` (the fields added to the base's config.json), the new
layers' safetensors (any float dtype; written float32 here, as the base's converted folder is) and
`recipe.json` (how they were made; its `files` sha256 are checked before composing). The marker
`outrider-composed.json` is written last: a folder without it is incomplete and composed again.

A shipped folder whose recipe names a `split.safetensors` is an MoE split of the base instead
(`smollm2-135m-moe8`, `qwen2.5-coder-0.5b-moe8`: catalog/moe_rebuild.py writes those folders).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

from ..config import cache_dir
from ..errors import ModelError
from .moe_rebuild import MOE_SPLITS, is_split, write_moe

SHIPPED = Path(__file__).resolve().parent.parent / "models" / "shipped"
COMPOSED = {"smollm2-135m-gdn": ("smollm2-135m-instruct", SHIPPED / "smollm2-135m-gdn"), **MOE_SPLITS}
MARKER = "outrider-composed.json"
COPIED = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def composed_path(name: str) -> Path:
    return cache_dir() / "models" / name


def is_composed(folder: Path) -> bool:
    return (Path(folder) / MARKER).is_file() and (Path(folder) / "model.safetensors").is_file()


def compose(base: Path, shipped: Path, folder: Path) -> Path:
    """Write `folder` from the base model folder and a shipped folder (a hybrid's layers or an MoE
    split); returns `folder`. A shipped file that is missing or changed is a one-line ModelError."""
    base, shipped, folder = Path(base), Path(shipped), Path(folder)
    try:
        recipe = json.loads((shipped / "recipe.json").read_text())
        for name, digest in recipe["files"].items():
            if hashlib.sha256((shipped / name).read_bytes()).hexdigest() != digest:
                raise ModelError(f"{shipped / name} does not have the sha256 recipe.json records; reinstall outrider")
    except (OSError, ValueError, KeyError) as err:
        raise ModelError(f"{shipped} is incomplete ({err}); reinstall outrider") from None
    part = folder.parent / f".{folder.name}.partial-{os.getpid()}"
    shutil.rmtree(part, ignore_errors=True)
    part.mkdir(parents=True)
    try:
        if is_split(shipped):  # an MoE split of the base (catalog/moe_rebuild.py)
            write_moe(base, shipped, part)
        else:
            _write_hybrid(base, shipped, recipe, part)
    except BaseException:
        shutil.rmtree(part, ignore_errors=True)
        raise
    (part / MARKER).write_text(json.dumps({"base": str(base), "shipped": str(shipped), "files": recipe["files"],
                                           "model_sha256": recipe.get("model_sha256")}, indent=1) + "\n")
    if folder.exists():
        shutil.rmtree(folder)
    part.rename(folder)
    return folder


def _write_hybrid(base: Path, shipped: Path, recipe: dict, part: Path) -> None:
    """The base's tensors less the replaced layers' attention, plus the shipped layers, into `part`."""
    new: dict[str, torch.Tensor] = {}
    for name in recipe["files"]:
        new.update(load_file(str(shipped / name)))
    hybrid = json.loads((shipped / "hybrid.json").read_text())
    raw = json.loads((base / "config.json").read_text())
    replaced = [i for i, t in enumerate(hybrid["layer_types"]) if t == "linear_attention"]
    if len(hybrid["layer_types"]) != int(raw["num_hidden_layers"]):
        raise ModelError(f"{shipped}: hybrid.json names {len(hybrid['layer_types'])} layers, the base has "
                         f"{raw['num_hidden_layers']}")
    dropped = tuple(f"model.layers.{i}.self_attn." for i in replaced)
    tensors = {k: v for k, v in load_file(str(base / "model.safetensors")).items() if not k.startswith(dropped)}
    tensors.update({k: v.float() for k, v in new.items()})
    (part / "config.json").write_text(json.dumps({**raw, **hybrid}, indent=2) + "\n")
    save_file(tensors, str(part / "model.safetensors"), metadata={"format": "pt"})
    for name in COPIED:
        if (base / name).is_file():
            shutil.copy2(base / name, part / name)


def pull_composed(name: str, pull_base: Callable[..., Path], log: Callable[[str], None] = print,
                  force: bool = False) -> Path:
    """The composed model `name` in the cache: its base pulled by `pull_base` (catalog/pull.py's
    pull, which calls this: passed in, so that this module does not import its caller) and composed."""
    base_name, shipped = COMPOSED[name]
    folder = composed_path(name)
    if is_composed(folder) and not force:
        recorded = json.loads((folder / MARKER).read_text())
        recipe = json.loads((shipped / "recipe.json").read_text())
        if (recorded.get("files"), recorded.get("model_sha256")) == (recipe["files"], recipe.get("model_sha256")):
            return folder
    base = pull_base(base_name, log=log)
    log(f"composing {name}: {base_name} + {shipped}")
    return compose(base, shipped, folder)
