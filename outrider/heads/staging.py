"""Write a head folder so that it appears whole or not at all: built in `.OUT.partial-PID` beside
`out`, renamed to `out` at the end, removed on any error (exports of every head kind)."""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

from safetensors.torch import save_file

WEIGHTS = "model.safetensors"


@contextmanager
def staged_head(out: Path, config: dict, tensors: dict):
    """Yields the work folder holding config.json and model.safetensors; what the caller adds
    there (a golden record) goes with them. `out` must be absent or empty (checked by the caller)."""
    work = out.parent / f".{out.name}.partial-{os.getpid()}"
    if work.exists():
        shutil.rmtree(work)  # our own pid's leftover
    work.mkdir(parents=True)
    try:
        (work / "config.json").write_text(json.dumps(config, indent=1) + "\n")
        save_file(tensors, str(work / WEIGHTS), metadata={"format": "pt"})
        (work / WEIGHTS).chmod(0o644)  # safetensors writes 0600; the other files get the umask's
        yield work
        if out.exists():
            out.rmdir()  # empty, checked by the caller
        work.rename(out)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
