"""`outrider bench`: every method on the same model and prompts, in one process.

Order of work, so that bad input fails before anything heavy happens:
    1. parse the methods TOML (methods.py) and load the workloads (data, fetched once);
    2. pull what is missing, then check that each drafter fits each model (tokenizer, layers);
    3. per model: load it, then per workload run every prompt through every method back to back
       (interleaved, so a slow drift of the machine hits all methods alike);
    4. the lossless audit: each of our methods' greedy output against our autoregressive output.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import __version__
from ..engine import eos_ids_of
from ..errors import ConfigError
from ..models.catalog import CATALOG, is_present, pull, resolve_model
from ..models.config import ModelConfig
from ..models.loader import load_decoder
from ..spec.setup import Speculator, tokenizer_mismatch
from .methods import BenchConfig
from .peers import PeerUnavailable, make_peer
from .runner import PromptRun, first_difference, run_ours
from .summary import summarize_run
from .workloads import Workload, load_workload

BASELINE = "autoregressive"


@dataclass
class Plan:
    config: BenchConfig
    workloads: list[Workload]
    model_paths: dict[str, Path]


def plan(config: BenchConfig, log=print) -> Plan:
    """Everything that can be checked before a model is loaded."""
    workloads = [load_workload(w, limit=config.prompts, max_new_tokens=config.max_new_tokens)
                 for w in config.workloads]
    needed = list(config.models)
    for m in config.methods:
        for extra in ([m.spec.argument] if m.spec and m.spec.kind == "draft-model" else []) + (
                [m.assistant] if m.assistant else []):
            if extra not in needed:
                needed.append(extra)
    paths = {}
    for name in needed:
        if name in CATALOG and not is_present(name):
            log(f"pulling {name} (once)")
            pull(name, log=log)
        paths[name] = resolve_model(name)
    for model in config.models:
        layers = ModelConfig.load(paths[model]).num_layers
        for m in config.methods:
            if not m.runs_on(model) or not m.spec:
                continue
            where = f"{config.source}:{m.line}" if m.line else config.source
            if m.spec.kind == "draft-model":
                reason = tokenizer_mismatch(paths[model], paths[m.spec.argument])
                if reason:
                    raise ConfigError(f"{where}: method '{m.name}' does not fit {model}: {reason}; "
                                      f"limit it with models = [...]")
            if m.spec.kind == "early-exit" and int(m.spec.argument) >= layers:
                raise ConfigError(f"{where}: method '{m.name}': {model} has {layers} layers, so early-exit "
                                  f"needs K below that; limit it with models = [...]")
    return Plan(config, workloads, paths)


def run_bench(p: Plan, threads: int | None = None, log=print, progress: bool = True) -> dict:
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging
    from tqdm import tqdm

    hf_logging.set_verbosity_error()
    threads = threads or p.config.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    runs, mismatches, skipped = [], [], []
    total = sum(len(w.prompts) * (1 + sum(m.runs_on(model) for m in p.config.methods))
                for model in p.config.models for w in p.workloads)
    bar = tqdm(total=total, disable=not progress, file=sys.stderr, dynamic_ncols=True)
    for model in p.config.models:
        path = p.model_paths[model]
        target = load_decoder(path)
        tok = AutoTokenizer.from_pretrained(str(path))
        eos = eos_ids_of(path, tok)
        methods = [m for m in p.config.methods if m.runs_on(model)]
        peers = {}
        for m in methods:
            if m.peer:
                try:
                    peers[m.name] = make_peer(m.peer, path, assistant_path=p.model_paths.get(m.assistant),
                                              lookup=m.lookup, threads=threads)
                except PeerUnavailable as why:
                    skipped.append({"model": model, "method": m.name, "reason": str(why)})
                    log(f"skipping peer {m.name} on {model}: {why}")
        for w in p.workloads:
            prompts = [_encode(tok, w, prompt) for prompt in w.prompts]
            specs = {m.name: Speculator.build(m.spec, target, path) for m in methods if m.spec}
            per_method: dict[str, list[PromptRun]] = {BASELINE: []}
            per_method.update({m.name: [] for m in methods if m.spec or m.name in peers})
            run_ours(target, None, prompts[0][:8], 2)  # warm-up
            for i, (prompt, ids) in enumerate(zip(w.prompts, prompts)):
                new = w.budget(prompt)
                for name in per_method:
                    bar.set_description(f"{model} | {w.name} | {i + 1}/{len(prompts)} | {name}")
                    if name == BASELINE:
                        r = run_ours(target, None, ids, new, eos)
                    elif name in specs:
                        r = run_ours(target, specs[name], ids, new, eos)
                    else:
                        r = peers[name].run(ids, new)
                    r.stats["first_difference"] = None
                    per_method[name].append(r)
                    bar.set_postfix_str(f"{len(r.output_ids) / max(r.seconds, 1e-9):.1f} tok/s")
                    bar.update(1)
                base = per_method[BASELINE][-1].output_ids
                for name, lst in per_method.items():
                    diff = first_difference(base, lst[-1].output_ids)
                    lst[-1].stats["first_difference"] = diff
                    if diff is not None and name in specs:
                        mismatches.append({"model": model, "workload": w.name, "method": name,
                                           "prompt": prompt.id, "first_difference": diff})
                        log(f"LOSSLESS AUDIT FAILED: {name} on {w.name} {prompt.id} differs from "
                            f"autoregressive at output token {diff}")
            by_name = {m.name: m for m in methods}
            for name, lst in per_method.items():
                method = by_name.get(name)
                kind = "baseline" if name == BASELINE else method.kind
                label = "autoregressive (ours)" if name == BASELINE else method.label
                runs.append(summarize_run(model, w, name, label, kind, lst, [x.id for x in w.prompts],
                                          peer=method.peer if method else None))
        del target
    bar.close()
    _speedups(runs)
    return {
        "outrider_version": __version__,
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "preset": None,
        "machine": {"processor": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "threads": threads, "device": "cuda" if torch.cuda.is_available() else "cpu",
                    "platform": platform.platform()},
        "versions": _versions(),
        "models": {name: _model_facts(name, path) for name, path in p.model_paths.items()},
        "config": {"source": p.config.source, **p.config.raw},
        "workloads": [{"name": w.name, "prompts": len(w.prompts), "chat": w.chat, "max_new_tokens": w.max_new_tokens,
                       "source": w.source, "description": w.description} for w in p.workloads],
        "runs": runs,
        "skipped": skipped,
        "audit": {"ok": not mismatches, "mismatches": mismatches},
    }


def _encode(tok, w: Workload, prompt) -> list[int]:
    if w.chat:
        messages = prompt.messages or [{"role": "user", "content": prompt.text}]
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tok(text, add_special_tokens=False)["input_ids"]
    return tok(prompt.text)["input_ids"]


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


def _model_facts(name: str, path: Path) -> dict:
    marker = Path(path) / "outrider.json"
    if marker.exists():
        facts = json.loads(marker.read_text())
        return {"path": str(path), "sha256": facts.get("sha256"), "sha256_of": "original GGUF",
                "params": getattr(CATALOG.get(name), "params", None)}
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

