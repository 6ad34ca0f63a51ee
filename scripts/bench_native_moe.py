"""A quantized mixture of experts on the native decoder layer (an MoE layer's attention in C, its
router and experts in torch: kernels/decoder_layer.py) against the torch layers, A/B interleaved in
one process: decode ms a token, prefill seconds, the same greedy tokens, and a suffix run on each.

    python scripts/bench_native_moe.py [--model DIR] [--dtype q8_0] [--prompt-tokens 64] [--new 48] [--repeats 3]

--model: a MoE folder (default: the catalog's smollm2-135m-moe8, `outrider models pull smollm2-135m-moe8`).
The prompt is token ids 1000, 1001, ... (the same for both). One thread.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from outrider.catalog.resolve import resolve_model
from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.sampling import SamplingParams
from outrider.weights.loader import load_decoder


def on_torch_layers(model):
    """The model with no native layer chosen: every layer in torch ops (the reference)."""
    model._choose_linear_paths()
    model._native = None
    model._choose_linear_paths = lambda: None
    return model


def run(model, prompt: list[int], new: int, spec=None) -> tuple[list[int], float, float]:
    t0 = time.perf_counter()
    done = generate_ids(model, [Request(prompt, new, SamplingParams(0.0))], set(), speculation=spec)[0]
    total = time.perf_counter() - t0
    return done.token_ids, total - done.stats["prefill_s"], done.stats["prefill_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-moe8")
    ap.add_argument("--dtype", default="q8_0")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    folder = Path(args.model) if Path(args.model).is_dir() else resolve_model(args.model)
    models = {"native": load_decoder(folder, "cpu", args.dtype),
              "torch": on_torch_layers(load_decoder(folder, "cpu", args.dtype))}
    prompt = list(range(1000, 1000 + args.prompt_tokens))
    for m in models.values():  # warm-up: paths chosen, kernels loaded
        run(m, prompt, 4)
    native = models["native"]._native
    if native is None or not native.moe:
        raise SystemExit(f"{folder.name} at {args.dtype} does not take the native layer with MoE layers")
    times = {name: [] for name in models}
    tokens = {}
    for i in range(args.repeats):
        for name, m in models.items():
            ids, decode, prefill = run(m, prompt, args.new)
            times[name].append((decode, prefill))
            tokens.setdefault(name, ids)
            print(json.dumps({"run": i, "layers": name, "decode_s": round(decode, 3), "prefill_s": round(prefill, 3)}),
                  flush=True)
    out = {name: {"decode_ms_per_token": round(1000 * sum(d for d, _ in t) / len(t) / max(args.new - 1, 1), 1),
                  "prefill_s": round(sum(p for _, p in t) / len(t), 3)} for name, t in times.items()}
    out["decode_speedup"] = round(out["torch"]["decode_ms_per_token"] / out["native"]["decode_ms_per_token"], 2)
    out["same_tokens"] = tokens["native"] == tokens["torch"]
    for name, m in models.items():
        spec = Speculator.build(SpecOptions("suffix", "chain", "fixed:4"), m, folder)
        ids, decode, _ = run(m, prompt, args.new, spec)
        out[f"suffix_{name}"] = {"decode_s": round(decode, 3), "tokens_equal_plain": ids == tokens[name]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
