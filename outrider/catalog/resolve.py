"""A model named by the user -> its folder: a catalog name, an imported GGUF's name, a folder, a .gguf file."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable

from ..errors import ModelError
from .imported import import_gguf, imported_folder, list_imported, normal_name
from .packages import CATALOG, DEFAULT_MODEL, model_path
from .pull import check


def list_models() -> list[dict]:
    """One row per catalog model: name, params, size, licence, present, state ("pulled", "not
    pulled" or "damaged"), problem (what the quick check found), path (and arch, default)."""
    rows = []
    for e in CATALOG.values():
        found = check(e.name)
        state = "pulled" if found.intact else "damaged" if found.found else "not pulled"
        rows.append({
            "name": e.name, "params": e.params, "size": f"{e.size_mb} MB", "licence": e.licence,
            "present": found.intact, "state": state, "problem": found.summary() if found.found else "",
            "path": str(model_path(e.name)), "arch": e.arch, "default": e.name == DEFAULT_MODEL,
        })
    return rows


SHIPPED = Path(__file__).resolve().parents[1] / "models" / "shipped"


def shipped_model(name: str) -> Path | None:
    """A whole model trained here and shipped in the package (outrider/models/shipped/NAME with its
    config.json, e.g. the Matryoshka suite `matryoshka-code-3`), found by its bare name; else None."""
    if not name or "/" in name or name.startswith("."):
        return None
    folder = SHIPPED / name
    return folder if (folder / "config.json").is_file() else None


def resolve_model(name_or_path: str | os.PathLike, log: Callable[[str], None] | None = None) -> Path:
    """A catalog name -> its pulled folder; an imported GGUF's name -> its folder (also as the user
    typed it: "My Smol Model" is the "my-smol-model" the import named, imported.normal_name); a folder
    path -> itself; a .gguf file -> its imported folder (imported first if need be, telling `log`, by
    default stderr: catalog/imported.py); a shipped model's name -> its folder in the package
    (shipped_model). Never pulls.

    A pulled folder gets the quick check (files present with their recorded sizes), so a
    truncated or missing file is refused here with what to run, not deep in the loader."""
    text = str(name_or_path)
    from .composed import COMPOSED, composed_path, is_composed

    if text in COMPOSED:  # a base model plus layers shipped in the package (catalog/composed.py)
        if not is_composed(composed_path(text)):
            raise ModelError(f"model '{text}' is not pulled yet: run `outrider models pull {text}`")
        return composed_path(text)
    if text in CATALOG:
        found = check(text)
        if not found.found:
            raise ModelError(f"model '{text}' is not pulled yet: run `outrider models pull {text}`")
        if found.problems:
            raise ModelError(f"model '{text}' in {model_path(text)} is damaged ({found.summary()}): "
                             f"run `outrider models pull {text}` to repair it")
        return model_path(text)
    shipped = shipped_model(text)
    if shipped is not None:
        return shipped
    imported = imported_folder(text)
    if imported is not None:
        return imported
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"{path} has no config.json: give a Hugging Face style model folder "
                             f"or one of {', '.join(CATALOG)}")
        return path
    if path.is_file() and path.suffix.lower() == ".gguf":
        return import_gguf(path, log=log or (lambda line: print(line, file=sys.stderr)), by_path=True)
    if path.exists():
        raise ModelError(f"{path} is a file: give a GGUF (.gguf), a model folder (with config.json) or a catalog name")
    # the name as typed, made a name as the import makes one ("My Smol Model" finds "my-smol-model")
    imported = imported_folder(normal_name(text)) if normal_name(text) != text else None
    if imported is not None:
        return imported
    if path.suffix.lower() == ".gguf":
        raise ModelError(f"no such file: {path}; check the path, or name a model: {known_names()}")
    raise ModelError(f"unknown model '{text}': known models are {known_names()} "
                     "(or give a GGUF file, a folder with config.json, or a name from `outrider models import`)")


def known_names() -> str:
    """The catalog's names and the imported models' (for an error message)."""
    from .composed import COMPOSED

    return ", ".join([*CATALOG, *COMPOSED, *(r["name"] for r in list_imported())])
