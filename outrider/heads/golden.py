"""Golden tau: the acceptance a head gets here on a fixed prompt set, recorded at export and re-measured
(the record every head kind writes; each kind measures it: heads/eagle3/golden.py, heads/dflash/golden.py).

`outrider export` measures the exported folder itself with our own speculative generation
(`LLM(target, drafter="eagle3:DIR")`: greedy, a chain of `depth` drafts per round, one torch
thread so the float arithmetic does not depend on how many cores were free) and writes
`outrider_golden.json` beside the weights; `outrider check-head` measures again and compares.

    {"format": 2, "target": {"name": ..., "path": ..., "architectures": [...]},
     "settings": {"temperature": 0.0, "tree": "chain", "depth": 4, "max_new_tokens": 32,
                  "chat": true, "device": "cpu", "dtype": "float32", "threads": 1, "linear": "linear"},
     "prompts": [...], "prompt_ids": [[...], ...],
     "results": [{"rounds": 9, "committed": 32, "output_ids": [...]}, ...],
     "rounds": 45, "committed": 160, "tau": 3.56,
     "measured_on": {"machine": "x86_64", "cpu": "...", "torch": "2.13.0", "device": "cpu"},
     "tolerance": {...}, "computes": {...}}                      # format 2: heads/golden_compute.py

tau is committed tokens per round over all prompts, bonus included (engine/stats.py). Comparison: on
the same machine (same `measured_on`) with the same settings the rounds and committed tokens
of every prompt must be equal; elsewhere the arithmetic may round differently and flip a near
tie, so tau may move: it must stay within 5% (float32) or 10% (bf16, fp16) of the golden.

Since issue 43 (format 2) the record also holds what the head computes on fixed inputs (`"computes"`,
heads/golden_compute.py; each kind's golden says which slots). The file is written one top-level
field a line (`write_golden`).
"""

from __future__ import annotations

import json
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from .golden_compute import recorded

GOLDEN = "outrider_golden.json"
PROMPTS = (
    "def fibonacci(n):",
    "Write a short poem about the sea.",
    "What is the capital of France?",
    "import json\n\ndef load_config(path):",
    "Explain what a hash map is in two sentences.",
)
TOLERANCE = {"float32": 0.05, "other": 0.10}  # relative, between machines
TOLERANCE_NOTE = ("exact on the same machine, device and dtype; elsewhere within 5% of the golden tau for "
                  "float32, 10% for bfloat16/float16")


@dataclass(frozen=True)
class GoldenSettings:
    depth: int = 4  # drafts per round (the chain's length): the speculators export's speculative_tokens
    max_new_tokens: int = 32
    device: str = "cpu"
    dtype: str = "float32"  # the target's (the head runs in it)
    chat: bool | None = None  # None: the chat template when the tokenizer has one


ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile")  # pick the CPU kernels


def machine(device: str) -> dict:
    """What the float arithmetic depends on: the CPU (model and the vector units that choose
    torch's kernels) or GPU, torch, the device."""
    cpu, flags = platform.processor(), []
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), cpu)
        present = next((line.split(":", 1)[1].split() for line in info if line.startswith("flags")), [])
        flags = [f for f in ISA_FLAGS if f in present]
    except OSError:
        pass
    out = {"machine": platform.machine(), "cpu": cpu, "cpu_flags": flags, "torch": torch.__version__,
           "device": device}
    if device.startswith("cuda") and torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return out


def record(measured: dict, target_name: str, target_path: Path, architectures: list[str]) -> dict:
    computes = recorded(measured["computes"], measured["settings"]["dtype"])
    rest = {k: v for k, v in measured.items() if k != "computes"}
    return {"format": 2, "target": {"name": target_name, "path": str(target_path), "architectures": architectures},
            **rest, "tolerance": {**TOLERANCE, "note": TOLERANCE_NOTE}, "computes": computes}


def write_golden(folder: Path, golden: dict) -> None:
    """One top-level field a line; "computes" one field a line and one prompt's list a line."""
    def field(key, value, indent=" "):
        if key == "computes":
            inner = ",\n".join(field(k, v, "  ") for k, v in value.items())
            return f'{indent}"computes": {{\n{inner}\n{indent}}}'
        if key in ("argmax", "logits", "anchors", "prompt_ids"):
            rows = ",\n".join(indent + "  " + json.dumps(row) for row in value)
            return f"{indent}{json.dumps(key)}: [\n{rows}\n{indent}]"
        return f"{indent}{json.dumps(key)}: {json.dumps(value)}"

    body = ",\n".join(field(k, v) for k, v in golden.items())
    (Path(folder) / GOLDEN).write_text("{\n" + body + "\n}\n")


def read_golden(folder: Path) -> dict | None:
    """The folder's golden record, None when it has none; ValueError when it is unreadable."""
    path = Path(folder) / GOLDEN
    if not path.is_file():
        return None
    golden = json.loads(path.read_text())
    for key in ("settings", "prompts", "prompt_ids", "results", "tau", "measured_on", "target"):
        if key not in golden:
            raise ValueError(f"{GOLDEN} lacks '{key}'")
    return golden


def settings_of(golden: dict, device: str | None = None) -> GoldenSettings:
    """The settings to re-measure with: the golden's, on `device` if given (else the golden's
    device when present here, else the CPU)."""
    s = golden["settings"]
    if device is None:
        device = s["device"] if not s["device"].startswith("cuda") or torch.cuda.is_available() else "cpu"
    return GoldenSettings(depth=int(s["depth"]), max_new_tokens=int(s["max_new_tokens"]), device=device,
                          dtype=str(s["dtype"]), chat=bool(s["chat"]))


def compare(golden: dict, measured: dict) -> tuple[bool, str]:
    """(ok, one line): is the re-measured tau the golden one (exact here, within tolerance elsewhere)?"""
    name = golden["target"].get("name")
    if measured["prompt_ids"] != golden["prompt_ids"]:
        return False, (f"the target encodes the golden prompts differently from the one the head was exported "
                       f"with ({name}); pass that target as --target")
    tau, gold = measured["tau"], golden["tau"]
    same = measured["measured_on"] == golden["measured_on"] and measured["settings"] == golden["settings"]
    if same:
        counts = lambda rs: [(r["rounds"], r["committed"]) for r in rs]  # noqa: E731
        if counts(measured["results"]) == counts(golden["results"]):
            return True, f"tau {tau:.3f} == golden {gold:.3f} (exact: same machine, device, dtype)"
        return False, (f"tau {tau:.3f} != golden {gold:.3f} on the same machine, device and dtype: the head or "
                       f"the target changed since export; check --target (exported for {name}) or re-export")
    limit = TOLERANCE["float32"] if golden["settings"]["dtype"] == "float32" else TOLERANCE["other"]
    off = abs(tau - gold) / max(gold, 1e-9)
    where = "another machine or device" if measured["measured_on"] != golden["measured_on"] else "other settings"
    if off <= limit:
        return True, f"tau {tau:.3f} vs golden {gold:.3f} ({where}: {off:.1%} <= {limit:.0%})"
    return False, (f"tau {tau:.3f} vs golden {gold:.3f} differs by {off:.1%} ({where}, allowed {limit:.0%}): the head "
                   f"drafts worse here; check --target (exported for {name}) and the head's weights, or re-export")
