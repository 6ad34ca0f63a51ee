"""Decode step time and K/V bytes a token: the packaged Qwen2.5-Coder-0.5B (grouped-query attention)
against itself converted to latent attention (train/mla_convert.py, Mha2MlaForCausalLM) at rank r,
the latent attended in the absorbed form (what decode runs) and, for comparison, the plain form
(every cached row expanded per head), at a few context lengths. Float32, torch layers, one thread;
thread CPU time of one decode step (one token after `context` cached, each model's cache filled
once a context), medians over rounds that interleave the three.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_mla_decode.py --rank 128 --contexts 64,512,2048
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from outrider.catalog.resolve import resolve_model
from outrider.models import latent_layer
from outrider.models.batch import pack
from outrider.train.mla_convert import convert
from outrider.weights.loader import load_decoder


def filled(model, context: int, tokens: torch.Tensor):
    """A cache holding `context` tokens, and the decode step after them (the step writes row
    `context` and leaves the length, so it can be run again and again)."""
    cache = model.new_cache(1, context + 2)
    model.forward(pack([0], [0], [tokens[:context]], logits="none", scratch_row=cache.scratch_row), cache)
    cache.set_length(0, context)
    return cache, pack([0], [context], [tokens[context:context + 1]], scratch_row=cache.scratch_row)


def step_time(model, cache, step) -> float:
    """Thread CPU seconds of one decode step."""
    start = time.thread_time()
    model.forward(step, cache)
    return time.thread_time() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--rank", type=int, default=128)
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--contexts", default="64,512,2048")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    source = resolve_model(args.model)
    raw = json.loads((source / "config.json").read_text())
    tensors = load_file(source / "model.safetensors")
    converted, mla_raw = convert(tensors, raw, args.rank, args.pairs)
    del tensors
    work = Path(tempfile.mkdtemp(prefix="bench_mla_"))
    save_file(converted, work / "model.safetensors")
    del converted
    (work / "config.json").write_text(json.dumps(mla_raw))
    models = {"gqa": load_decoder(source, "cpu", torch.float32), "mla": load_decoder(work, "cpu", torch.float32)}
    contexts = [int(c) for c in args.contexts.split(",")]
    tokens = torch.randint(100, 20000, (max(contexts) + 1,), generator=torch.Generator().manual_seed(0))
    forms = {"gqa": None, "mla absorbed": True, "mla plain": False}
    times = {(f, c): [] for f in forms for c in contexts}
    real = latent_layer.absorbed_form
    for context in contexts:  # each model's cache filled once a context, then steps interleaved
        states = {name: filled(m, context, tokens) for name, m in models.items()}
        for _ in range(args.rounds + 1):  # the first round warms
            for form, absorbed in forms.items():
                latent_layer.absorbed_form = real if absorbed is None else (lambda rows, m, a=absorbed: a)
                name = "gqa" if absorbed is None else "mla"
                times[form, context].append(step_time(models[name], *states[name]))
        for form in forms:
            times[form, context] = times[form, context][1:]
    latent_layer.absorbed_form = real
    bytes_per_token = {name: m.new_cache(1, 1).nbytes() // 2 for name, m in models.items()}
    rows = [{"form": f, "context": c, "step_ms": 1000 * statistics.median(times[f, c])} for f in forms for c in contexts]
    print(f"K/V bytes a token: gqa {bytes_per_token['gqa']}, mla r {args.rank} {bytes_per_token['mla']}")
    print("| context | " + " | ".join(forms) + " |")
    for c in contexts:
        print(f"| {c} | " + " | ".join(f"{1000 * statistics.median(times[f, c]):.1f} ms" for f in forms) + " |")
    if args.out:
        args.out.write_text(json.dumps({"bytes_per_token": bytes_per_token, "rows": rows, "args": vars(args)},
                                       indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
