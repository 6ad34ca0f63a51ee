"""What a bench run's results.json holds, built from its saved prompts (store.py).

An uninterrupted run and a run finished with --resume build their results the same way, from the
same saved lines, so they differ only in what was measured (seconds) and in `sessions`.

    identity(...)   what a run is: models (sha256), methods, workloads and their prompts, threads;
                    saved as run.json, compared by --resume
    assemble(...)   the results: one entry per (model, workload, method) with every prompt's
                    output ids and stats, the summaries, speed-ups and the lossless audit
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
import os
import platform
from pathlib import Path

import torch

from .. import __version__
from ..config import describe
from ..catalog.packages import CATALOG
from .runner import PromptRun
from .store import SETTINGS, RunStore
from .summary import summarize_run

BASELINE = "autoregressive"


def identity(p, model_facts: dict[str, dict], threads: int) -> dict:
    """The settings a resumed run must share with the run it finishes (p: a run.Plan)."""
    return {
        "outrider_version": __version__,
        "targets": list(p.config.models),
        "model_sha256": {name: facts["sha256"] for name, facts in model_facts.items()},
        "model_dtype": {name: facts.get("dtype") for name, facts in model_facts.items()},
        # a float16 cache is another model (named only then: runs saved before it resume as they did)
        **({"kv_dtype": p.config.kv_dtype} if p.config.kv_dtype not in (None, "float32") else {}),
        "methods": [{k: v for k, v in dataclasses.asdict(m).items() if k != "line"} for m in p.config.methods],
        "workloads": [{"name": w.name, "source": w.source, "chat": w.chat,
                       "prompts": [[q.id, w.budget(q)] for q in w.prompts]} for w in p.workloads],
        "threads": threads,
        # a bench that samples is another run (named only then: greedy runs saved before resume as they did)
        **({"sampling": _sampling(p).describe()} if not _sampling(p).greedy else {}),
        # a budgeted run is another run (named only then: runs saved before resume as they did)
        **({"expert_budget": p.config.expert_budget} if p.config.expert_budget else {}),
        # not compared on --resume, read back by it (settings.py): the methods file as it ran
        SETTINGS: {"preset": p.config.preset, "source": p.config.source, "config": p.config.raw},
    }


def method_names(p, model: str, store: RunStore) -> list[str]:
    """The methods run on `model`, in run order: the baseline, then the file's methods less the
    peers skipped on it."""
    skipped = store.skipped_on(model)
    return [BASELINE] + [m.name for m in p.config.methods if m.runs_on(model) and m.name not in skipped]


def assemble(p, store: RunStore, model_facts: dict[str, dict], threads: int) -> dict:
    """results.json from the saved prompts; every prompt of the plan must be saved."""
    runs, mismatches = [], []
    lossy = lossy_methods(p.config)  # their differences are what they are, shown, not a failed audit
    for model in p.config.models:
        by_name = {m.name: m for m in p.config.methods}
        names = method_names(p, model, store)
        for w in p.workloads:
            lines = [store.done(model, w.name, q.id) for q in w.prompts]
            for q, line in zip(w.prompts, lines):
                for name in names:
                    diff = line["runs"][name]["stats"].get("first_difference")
                    if diff is not None and name != BASELINE and by_name[name].spec and name not in lossy:
                        mismatches.append({"model": model, "workload": w.name, "method": name,
                                           "prompt": q.id, "first_difference": diff})
            for name in names:
                method = by_name.get(name)
                kind = "baseline" if name == BASELINE else method.kind
                label = "autoregressive (ours)" if name == BASELINE else method.label
                lst = [PromptRun(ln["runs"][name]["output_ids"], ln["runs"][name]["seconds"],
                                 ln["runs"][name]["stats"]) for ln in lines]
                runs.append(summarize_run(model, w, name, label, kind, lst, [x.id for x in w.prompts],
                                          peer=method.peer if method else None))
                if name in lossy:
                    runs[-1]["summary"]["lossy"] = True
    _speedups(runs)
    sampling = _sampling(p)
    if not sampling.greedy:  # token equality says nothing of a sampled method: the audit does
        for r in runs:
            r["summary"]["mismatches"] = r["summary"]["lossless"] = None
    return {
        "outrider_version": __version__,
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "preset": None,
        "sessions": store.sessions,
        "machine": {"processor": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "threads": threads, "device": "cuda" if torch.cuda.is_available() else "cpu",
                    "platform": platform.platform()},
        "versions": _versions(),
        "runtime": describe(),  # the config in force, the CPU's instruction sets, the kernels that ran
        "models": model_facts,
        "config": {"source": p.config.source, **p.config.raw},  # flags folded in: what ran
        "workloads": [{"name": w.name, "prompts": len(w.prompts), "chat": w.chat, "max_new_tokens": w.max_new_tokens,
                       "source": w.source, "description": w.description} for w in p.workloads],
        "runs": runs,
        "skipped": list(store.skipped),  # "failed": true for a peer that crashed
        "peer_notes": list(store.notes),
        "sampling": sampling.describe(),
        "audit": {"ok": not mismatches, "mismatches": mismatches} if sampling.greedy else _audit(p, store),
    }


def lossy_methods(config) -> set[str]:
    """The methods whose verifier is lossy by name (spec/verifiers.py: `resispec-lossy`,
    `verify-skip-lossy:T`, ...): run, shown and marked lossy, never counted against the audit."""
    from ..spec.verifiers import verifier_entry

    return {m.name for m in config.methods
            if m.spec and m.spec.verifier and (e := verifier_entry(m.spec.verifier)) is not None and e.lossy}


def _sampling(p):
    from .sampling import BenchSampling

    return BenchSampling.of(p.config)


def _audit(p, store: RunStore) -> dict:
    """The distributional audit (bench/audit.py): per model, each method's verdict over its
    audited workloads; `ok` when every lossless method of every model passed."""
    from .audit import ALPHA, LEAST, summarize

    lossy = lossy_methods(p.config)
    models = {}
    for model in p.config.models:
        audits = [a for w in p.workloads if (a := store.audited(model, w.name))]
        models[model] = {"prompts": audits, **summarize(audits, lossy)}
    return {"kind": "distributional", "alpha": ALPHA, "least": LEAST, "correction": "bonferroni",
            "ok": all(m["ok"] for m in models.values()), "mismatches": [], "models": models,
            "not_audited": sorted({m.name for m in p.config.methods if m.peer})}


def _speedups(runs: list[dict]) -> None:
    """Ratios within the same (model, workload): vs our baseline and vs transformers' generate."""
    for r in runs:
        same = [x for x in runs if x["model"] == r["model"] and x["workload"] == r["workload"]]
        base = next(x for x in same if x["method"] == BASELINE)["summary"]["tokens_per_s"]
        hf = next((x["summary"]["tokens_per_s"] for x in same if x.get("peer") == "transformers"), None)
        s = r["summary"]
        s["speedup_vs_baseline"] = s["tokens_per_s"] / base if base else None
        s["speedup_vs_transformers"] = s["tokens_per_s"] / hf if hf else None


def _versions() -> dict:
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}


def model_facts(name: str, path: Path) -> dict:
    """Where a model is and the sha256 that names its weights (the GGUF's for catalog models)."""
    marker = Path(path) / "outrider.json"
    if marker.exists():
        facts = json.loads(marker.read_text())
        return {"path": str(path), "sha256": facts.get("sha256"), "sha256_of": "original GGUF",
                "params": getattr(CATALOG.get(name), "params", None)}
    imported = Path(path) / "imported.json"  # a GGUF of one's own (catalog/imported.py)
    if imported.exists():
        facts = json.loads(imported.read_text())
        return {"path": str(path), "sha256": facts.get("sha256"), "sha256_of": "imported GGUF", "params": None}
    digest = hashlib.sha256()
    for f in sorted(Path(path).glob("*.safetensors")):
        with open(f, "rb") as handle:
            while chunk := handle.read(1 << 24):
                digest.update(chunk)
    return {"path": str(path), "sha256": digest.hexdigest(), "sha256_of": "safetensors files", "params": None}


def write_results(results: dict, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "results.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=2))
    os.replace(tmp, path)
    return path


def needs_exit_failure(results: dict) -> bool:
    return not results["audit"]["ok"]
