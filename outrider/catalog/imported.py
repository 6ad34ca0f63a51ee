"""A GGUF file of one's own (llama.cpp's format) as a model: `outrider models import FILE.gguf`, or
`--model FILE.gguf` anywhere a model is named (imported on first use, then found by its path).

    folder = import_gguf("qwen2.5-1.5b-instruct-q4_k_m.gguf")   # -> $OUTRIDER_CACHE/imported/<name>/
    resolve_model("qwen2.5-1.5b-instruct-q4_k_m")               # the folder, by its name, from then on
    resolve_model("./qwen2.5-1.5b-instruct-q4_k_m.gguf")        # the same folder (imported if need be)

The folder holds what a model folder needs beside its weights, made from the GGUF's metadata
(weights/gguf_convert.py: config.json, the tokenizer files, generation_config.json), and the GGUF itself as
original.gguf: a hard link to the file (no copy; the file stays where it is) or, across file
systems, a symbolic link. No float32 copy is written: quantized dtypes read the GGUF's own blocks
(weights/quant_load.py; the default on a CPU is the file's own quantization, as for a packaged model) and
float dtypes dequantize its tensors at load (quant_load.GGUFFloats). imported.json is written last:
where the file came from, its size, mtime and sha256, so an import cut short is not taken for a
model, and a GGUF changed or moved since is refused in one line that says to import it again.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Callable

from ..config import cache_dir
from ..errors import ModelError
from ..weights.gguf_convert import GGUF_NAME
from .locks import pull_lock
from .marker import file_sha256
from .packages import CATALOG

IMPORTED_NAME = "imported.json"
NAME = re.compile(r"[a-z0-9][a-z0-9._-]*")  # an imported model's name


def imported_root() -> Path:
    return cache_dir() / "imported"


def normal_name(text: str) -> str:
    """`text` as a model name: lowercased, each run of characters outside [a-z0-9._-] made a dash,
    no leading or trailing dash or dot ("My Smol Model" -> "my-smol-model"); "" when nothing is left.
    The import names a file so, and a name is looked up so: the name the user typed keeps working."""
    return re.sub(r"[^a-z0-9._-]+", "-", text.lower()).strip("-.")


def default_name(gguf: Path) -> str:
    """The name a GGUF is imported under: its file name without `.gguf`, lowercased, with any
    character outside [a-z0-9._-] made a dash ("Qwen2.5 1.5B Q4_K_M.gguf" -> "qwen2.5-1.5b-q4_k_m")."""
    return normal_name(gguf.name[: -len(".gguf")]) or "model"


def _source_facts(gguf: Path) -> dict:
    stat = gguf.stat()
    return {"source": str(gguf.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def imported_folder(name: str) -> Path | None:
    """The folder of the model imported as `name`, or None when there is none; ModelError when
    its GGUF has gone or changed since (with the command that imports it again)."""
    if not NAME.fullmatch(name):
        return None
    folder = imported_root() / name
    marker = folder / IMPORTED_NAME
    if not marker.is_file():
        return None
    problem = damage(name, folder, json.loads(marker.read_text()))
    if problem:
        raise ModelError(f"imported model '{name}': {problem}")
    return folder


def damage(name: str, folder: Path, facts: dict) -> str | None:
    """What is wrong with the import in `folder` (its imported.json `facts`), with the command that
    imports it again, or None: its GGUF is gone, or its size or mtime is not the one recorded (a
    file truncated, rewritten or replaced since; the link is the file itself, no copy)."""
    gguf = folder / GGUF_NAME
    if not gguf.is_file():
        return (f"its GGUF ({facts['source']}) is gone; import it again with "
                f"`outrider models import FILE.gguf --name {name} --force`")
    stat = gguf.stat()
    if (stat.st_size, stat.st_mtime_ns) != (facts["size"], facts["mtime_ns"]):
        return (f"its GGUF ({facts['source']}) changed since it was imported ({stat.st_size} bytes, "
                f"{facts['size']} recorded); run `outrider models import {facts['source']} --name {name} --force`")
    return None


def list_imported() -> list[dict]:
    """Every imported model: name, folder, source file and its size, for `models list`; "problem":
    what `damage` finds (its GGUF gone or changed since the import, with what to run), else ""."""
    root = imported_root()
    rows = []
    for marker in sorted(root.glob(f"*/{IMPORTED_NAME}")) if root.is_dir() else []:
        facts = json.loads(marker.read_text())
        name = marker.parent.name
        rows.append({"name": name, "path": marker.parent, **facts,
                     "problem": damage(name, marker.parent, facts) or ""})
    return rows


def _link(gguf: Path, target: Path) -> str:
    """original.gguf as a hard link to `gguf` (the same file system), else a symbolic link."""
    try:
        os.link(gguf, target)
        return "hard link"
    except OSError:
        os.symlink(gguf.resolve(), target)
        return "symbolic link"


def _source_of(folder: Path) -> str | None:
    marker = folder / IMPORTED_NAME
    return json.loads(marker.read_text()).get("source") if marker.is_file() else None


def import_gguf(gguf: str | os.PathLike, name: str | None = None, force: bool = False,
                log: Callable[[str], None] = print, by_path: bool = False) -> Path:
    """Import `gguf` as model `name` (default: `default_name`); returns its folder. Importing the
    same unchanged file again returns the folder at once; another file under a name already
    imported is refused unless `force` (which replaces it). `by_path` (a model named by its
    file): where the default name is another file's, the name gets 8 hex digits of the path."""
    from ..weights.gguf_index import GGUFIndex

    gguf = Path(gguf).expanduser()
    if not gguf.is_file():
        raise ModelError(f"{gguf}: no such GGUF file")
    if gguf.suffix.lower() != ".gguf":
        raise ModelError(f"{gguf} is not a .gguf file: give a GGUF (llama.cpp's format) to import")
    name = name or default_name(gguf)
    if by_path and _source_of(imported_root() / name) not in (None, str(gguf.resolve())):
        name = f"{name}-{hashlib.sha256(str(gguf.resolve()).encode()).hexdigest()[:8]}"
    if not NAME.fullmatch(name):
        hint = f" (e.g. --name {normal_name(name)})" if NAME.fullmatch(normal_name(name)) else ""
        raise ModelError(f"'{name}' is not a model name: use lowercase letters, digits, '.', '_' and '-'{hint}")
    if name in CATALOG:
        raise ModelError(f"'{name}' is a packaged model's name: import under another with --name")
    folder = imported_root() / name
    facts = _source_facts(gguf)
    if (done := _already(folder, facts, force)) is not None:
        return done
    GGUFIndex.open(gguf)  # a damaged or truncated file is refused here, in one line
    folder.parent.mkdir(parents=True, exist_ok=True)
    with pull_lock(folder, log):  # imports of one name take turns (catalog/locks.py)
        if (done := _already(folder, facts, force)) is not None:  # imported meanwhile
            return done
        _write(gguf, folder, facts, log)
    return folder


def _already(folder: Path, facts: dict, force: bool) -> Path | None:
    """The folder when it already holds this unchanged file's import; None when it must be
    (re)imported; ModelError when it holds another file's (unless `force`)."""
    marker = folder / IMPORTED_NAME
    if not marker.is_file():
        return None
    old = json.loads(marker.read_text())
    if old.get("source") != facts["source"] and not force:
        raise ModelError(f"a model '{folder.name}' is already imported from {old.get('source')}: pass --name NAME "
                         f"to import this one beside it, or --force to replace it")
    unchanged = all(old.get(k) == facts[k] for k in ("source", "size", "mtime_ns"))
    return folder if unchanged and (folder / GGUF_NAME).is_file() and not force else None


def _write(gguf: Path, folder: Path, facts: dict, log: Callable[[str], None]) -> None:
    """The folder, made beside it under a temporary name and moved into place when complete."""
    from ..weights.gguf_convert import convert_gguf

    partial = folder.parent / f".{folder.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        config = convert_gguf(gguf, partial, log=log, weights=False)
        how = _link(gguf, partial / GGUF_NAME)
        log(f"hashing {gguf.name} ({facts['size'] / 1e9:.2f} GB)")
        facts = {**facts, "sha256": file_sha256(gguf), "link": how, "model_type": config["model_type"]}
        (partial / IMPORTED_NAME).write_text(json.dumps(facts, indent=2) + "\n")
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(partial, folder)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    log(f"imported {gguf} as '{folder.name}' ({how}): {folder}")
