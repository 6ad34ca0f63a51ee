"""Gemma 3 270M at a long context, its sliding layers' K/V kept whole (every row, masked: config
sliding_ring=off) and in rings (models/ring_cache.py): resident K/V bytes, the prefill's thread CPU
time (one each, not interleaved), and
decode steps A/B interleaved (thread CPU time of one step at the context, medians), the two states'
greedy tokens and logits compared. Weights as the catalog ships them (--dtype gguf), torch layers
(a Gemma block never takes the native layer), one thread.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_sliding_ring.py --context 4096 --steps 32
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from outrider.catalog.resolve import resolve_model
from outrider.config import overriding
from outrider.models.batch import pack
from outrider.weights.loader import load_decoder
from outrider.weights.tokenizer import load_tokenizer


def prompt_ids(tok, context: int) -> list[int]:
    """`context` tokens of the repository's docs, read in order (repeated if short)."""
    text = "".join(p.read_text() for p in sorted((Path(__file__).parents[1] / "docs").glob("*.md")))
    ids = tok(text)["input_ids"]
    while len(ids) < context:
        ids = ids + ids
    return ids[:context]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--dtype", default="gguf")
    ap.add_argument("--ring-first", action="store_true", help="prefill the rings' state first (order effects)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    path = resolve_model("gemma3-270m")
    model = load_decoder(path, "cpu", args.dtype)
    ids = torch.tensor(prompt_ids(load_tokenizer(path), args.context))
    fill = args.context - args.steps
    states = {}
    order = (("full", False), ("ring", True))
    for name, ring in (order[::-1] if args.ring_first else order):
        with overriding(sliding_ring=ring):
            cache = model.new_cache(1, args.context + 8)
        t, cpu = time.perf_counter(), time.thread_time()
        model.forward(pack([0], [0], [ids[:fill]], logits="none", scratch_row=cache.scratch_row), cache)
        cache.set_length(0, fill)
        print(f"{name}: {type(cache).__name__}, prefill {fill} tokens {time.thread_time() - cpu:.1f} s thread CPU "
              f"({time.perf_counter() - t:.1f} s wall)", flush=True)
        states[name] = cache
    times = {name: [] for name in states}
    tokens = {name: [] for name in states}
    worst = 0.0
    for step in range(args.steps):  # interleaved: the same position in each state, one after the other
        logits = {}
        for name, cache in states.items():
            at = fill + step
            t = time.thread_time()
            out = model.forward(pack([0], [at], [ids[at:at + 1]], scratch_row=cache.scratch_row), cache)
            times[name].append(time.thread_time() - t)
            cache.set_length(0, at + 1)
            logits[name] = out.logits[0, -1]
            tokens[name].append(int(out.logits[0, -1].argmax()))
        worst = max(worst, (logits["full"] - logits["ring"]).abs().max().item())
    for name, cache in states.items():
        extra = ""
        if hasattr(cache, "bytes_per_slot"):
            extra = (f" ({cache.bytes_per_token()} B a token in the global layers + {cache.bytes_per_slot()} B "
                     f"a slot in the rings)")
        print(f"{name}: K/V resident {cache.nbytes() / (1 << 20):.1f} MiB at {args.context + 8} rows{extra}; "
              f"decode step median {statistics.median(times[name]) * 1000:.1f} ms "
              f"(min {min(times[name]) * 1000:.1f})", flush=True)
    print(f"ring / full decode step: {statistics.median(times['ring']) / statistics.median(times['full']):.3f}; "
          f"argmax equal at every step: {tokens['full'] == tokens['ring']}; max |logit diff| {worst:.2e}")


if __name__ == "__main__":
    main()
