"""Write a head folder so that it appears whole or not at all: built in `.OUT.partial-PID` beside
`out`, renamed to `out` at the end, removed on any error (exports of every head kind); `out`
refused before any work when it is not new or empty, and the dtypes an export may write."""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..errors import ConfigError

WEIGHTS = "model.safetensors"
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


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


def check_out(out: str | Path) -> Path:
    """`out` as a Path, refused in one line when it exists and is not an empty folder."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out} already exists and is not empty; give a new or empty folder")
    return out
