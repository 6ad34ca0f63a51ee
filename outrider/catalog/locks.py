"""The pull lock: two pulls (or imports) of one model take turns."""

from __future__ import annotations

import fcntl
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator


@contextmanager
def pull_lock(final: Path, log: Callable[[str], None]) -> Iterator[bool]:
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


