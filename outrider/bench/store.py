"""The out folder of a bench run: checked before anything loads, written as prompts finish.

    OUT/run.json        the run's identity: models (with their sha256), methods, workloads with
                        their prompt ids and budgets, threads. `--resume` refuses a different one.
                        Beside it, "settings": the methods file as it ran (flags folded in), which
                        `--resume` reads back (settings.py); not part of the identity compared.
    OUT/prompts.jsonl   one JSON line per finished prompt: every method's output ids, seconds and
                        stats; also a line per session started, per peer skipped or failed, and
                        per note a peer gave of its settings, and (a bench that samples) per
                        workload's distributional audit on a model (bench/audit.py). Each line is flushed and fsynced when
                        written, so an interrupted run keeps them.
    OUT/results.json    written when the whole run is done (report.md, report.html beside it);
                        its presence marks a finished run.

A prompt is the unit of work: all its methods run back to back, then its line is written. A run
that stops part-way keeps every finished prompt; `--resume` reads them back and runs the rest.
A broken last line (the process killed mid-write) is dropped and that prompt runs again.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError

IDENTITY = "run.json"
SETTINGS = "settings"  # run.json's key of the run's own settings (not compared)
PROGRESS = "prompts.jsonl"
RESULTS = "results.json"


class BenchInterrupted(KeyboardInterrupt):
    """Ctrl-C during a bench run; the finished prompts are saved in `out` (None: kept in memory)."""

    def __init__(self, done: int, total: int, out: Path | None):
        super().__init__(f"{done} of {total} prompts finished")
        self.done, self.total, self.out = done, total, out


def check_out(out: Path, resume: bool) -> None:
    """Refuse an --out that cannot take this run, before any model loads; create the folder.

    Fresh run: a new or empty folder. --resume: a folder holding an unfinished run."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a folder; pick a folder that does not exist yet")
    if (out / RESULTS).exists():
        raise ConfigError(f"--out {out} already holds a finished run ({RESULTS}); pick another --out")
    unfinished = (out / IDENTITY).is_file()
    if unfinished and not resume:
        raise ConfigError(f"--out {out} holds an unfinished run; pass --resume to finish it, or pick another --out")
    if resume and not unfinished:
        raise ConfigError(f"--out {out} holds no unfinished run to resume (no {IDENTITY}); drop --resume")
    if not unfinished and out.is_dir() and any(out.iterdir()):
        raise ConfigError(f"--out {out} is a folder that already holds other files; pick a new or empty folder")
    probe = out / ".write-test"
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"--out {out}: cannot write there ({err.strerror}); pick a folder you can write to") from None


@dataclass
class RunStore:
    """The finished prompts of one run, in memory and (when `out` is given) on disk."""

    out: Path | None
    identity: dict
    prompts: dict[tuple[str, str, str], dict] = field(default_factory=dict)  # (model, workload, id) -> line
    skipped: list[dict] = field(default_factory=list)  # peers skipped (not here) or failed (crashed)
    notes: list[dict] = field(default_factory=list)  # what a peer said of its own settings
    sessions: int = 0
    audits: dict[tuple[str, str], dict] = field(default_factory=dict)  # (model, workload) -> audit_prompt's result

    @staticmethod
    def open(out: Path | None, identity: dict, resume: bool = False) -> "RunStore":
        """A fresh store (writes run.json), or with `resume` the unfinished run in `out`, refused
        when its identity differs from `identity`. A new session line is written either way."""
        identity = json.loads(json.dumps(identity))  # the form it has once saved: lists, str keys
        store = RunStore(None if out is None else Path(out), identity)
        if store.out is not None and resume:
            saved = json.loads((store.out / IDENTITY).read_text(encoding="utf-8"))
            change = difference(_compared(saved), _compared(identity))
            if change:
                raise ConfigError(f"--out {out} holds a run with other settings ({change}); "
                                  "resume it with the settings it started with, or pick another --out")
            store._read_progress()
        elif store.out is not None:
            _write_atomic(store.out / IDENTITY, json.dumps(identity, indent=2))
            (store.out / PROGRESS).write_text("", encoding="utf-8")
        store._add({"kind": "session", "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")})
        return store

    # -- reading ----------------------------------------------------------------------------------
    def done(self, model: str, workload: str, prompt_id: str) -> dict | None:
        """The saved line of this prompt (its "runs" by method), or None when it has not finished."""
        return self.prompts.get((model, workload, prompt_id))

    def audited(self, model: str, workload: str) -> dict | None:
        """The saved distributional audit of `workload` on `model`, or None."""
        return self.audits.get((model, workload))

    def skipped_on(self, model: str) -> dict[str, str]:
        """Method name -> reason, for the peers skipped on `model`."""
        return {s["method"]: s["reason"] for s in self.skipped if s["model"] == model}

    # -- writing ----------------------------------------------------------------------------------
    def add_prompt(self, model: str, workload: str, prompt_id: str, runs: dict[str, dict]) -> dict:
        """Save one finished prompt: runs = {method: {"output_ids", "seconds", "stats"}}."""
        return self._add({"kind": "prompt", "model": model, "workload": workload, "prompt": prompt_id,
                          "runs": runs})

    def notes_on(self, model: str) -> dict[str, str]:
        """Method name -> the note its peer gave on `model`."""
        return {n["method"]: n["note"] for n in self.notes if n["model"] == model}

    def add_skipped(self, model: str, method: str, reason: str, failed: bool = False) -> None:
        """A peer that does not run on `model` from here on: not here (skipped), or crashed (failed)."""
        self._add({"kind": "skipped", "model": model, "method": method, "reason": reason,
                   **({"failed": True} if failed else {})})

    def add_audit(self, model: str, workload: str, audit: dict) -> None:
        """Save one workload's distributional audit on `model` (bench/audit.audit_prompt's result)."""
        self._add({"kind": "audit", "model": model, "workload": workload, "audit": audit})

    def add_note(self, model: str, method: str, note: str) -> None:
        self._add({"kind": "note", "model": model, "method": method, "note": note})

    def _add(self, line: dict) -> dict:
        text = json.dumps(line, ensure_ascii=False)
        line = json.loads(text)  # what a resumed run reads back, so both build the same results
        if self.out is not None:
            with open(self.out / PROGRESS, "a", encoding="utf-8") as f:
                f.write(text + "\n")
                f.flush()
                os.fsync(f.fileno())
        self._take(line)
        return line

    def _take(self, line: dict) -> None:
        if line["kind"] == "prompt":
            self.prompts[(line["model"], line["workload"], line["prompt"])] = line
        elif line["kind"] == "skipped":
            self.skipped.append({k: line[k] for k in ("model", "method", "reason", "failed") if k in line})
        elif line["kind"] == "note":
            self.notes.append({k: line[k] for k in ("model", "method", "note")})
        elif line["kind"] == "audit":
            self.audits[(line["model"], line["workload"])] = line["audit"]
        elif line["kind"] == "session":
            self.sessions += 1

    def _read_progress(self) -> None:
        """Load the saved lines; cut a broken last line off the file (a write that never ended)."""
        path = self.out / PROGRESS
        data = path.read_bytes() if path.exists() else b""
        good = 0
        for raw in data.split(b"\n"):
            end = good + len(raw) + 1
            if end > len(data):  # no newline after it: unfinished
                break
            try:
                self._take(json.loads(raw))
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
                break
            good = end
        if good < len(data):
            with open(path, "r+b") as f:
                f.truncate(good)


def _compared(identity: dict) -> dict:
    return {k: v for k, v in identity.items() if k != SETTINGS}


def difference(old, new, where: str = "") -> str | None:
    """The first place two JSON values differ, as "path: old then, new now"; None when equal."""
    if isinstance(old, dict) and isinstance(new, dict):
        for key in list(old) + [k for k in new if k not in old]:
            found = difference(old.get(key), new.get(key), f"{where}.{key}" if where else key)
            if found:
                return found
        return None
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        for i, (a, b) in enumerate(zip(old, new)):
            found = difference(a, b, f"{where}[{i}]")
            if found:
                return found
        return None
    if old == new:
        return None
    return f"{where}: {_short(old)} then, {_short(new)} now"


def _short(value) -> str:
    if isinstance(value, list):
        return f"{len(value)} items"
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "..."


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
