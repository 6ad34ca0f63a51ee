"""Time of one projection: float32 against the quantized kernels, on SmolLM2's shapes.

    .venv/bin/python scripts/bench_quant_kernels.py [--threads 2] [--rounds 7] [--rows 1,4,8]

For every shape and row count, each candidate runs `calls` times in a round; rounds alternate the
candidates, so a burst of load from elsewhere hits them all, and the best round counts. Printed:
milliseconds per call and the ratio to float32 (layers.linear) in the same run. The int4 kernels
take bfloat16 activations inside (quant_linear.py says why); the native and blockwise kernels are
float32. The same weight is read on every call, so it sits in the CPU's caches: this measures
compute, not the memory traffic a whole model's decode step has (scripts/bench_decode.py).
Also timed, for information only: torch's int8 kernel with one scale per output row, which is NOT
Q8_0 (Q8_0 has a scale per 32 values; mapping it there means quantizing again, a different model).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

SHAPES = [(576, 576), (1536, 576), (576, 1536), (49152, 576)]  # (out, in): q/o, gate/up, down, head


def candidates(weight: torch.Tensor) -> dict:
    from outrider.models.layers import linear
    from outrider.kernels.blocks import quantize
    from outrider.kernels.quant_linear import QuantLinear, choose_kernel

    found = {"float32": lambda x: linear(x, weight)}
    for kind in ("q8_0", "q4_1"):
        blocks = quantize(weight, kind)
        for kernel in dict.fromkeys((choose_kernel(blocks, fast=True), choose_kernel(blocks), "blockwise")):
            q = QuantLinear(blocks, kernel=kernel)
            found[f"{kind} {q.kernel}"] = q.linear
    codes = torch.randint(-127, 128, weight.shape, dtype=torch.int8)
    scales = torch.rand(weight.shape[0], dtype=torch.bfloat16)
    found["int8 per-row, bf16 (not Q8_0)"] = lambda x: torch.ops.aten._weight_int8pack_mm(
        x.bfloat16(), codes, scales).float()
    return found


def best_times(fns: dict, x: torch.Tensor, calls: int, rounds: int) -> dict:
    for fn in fns.values():  # warm-up
        fn(x)
    best = {name: float("inf") for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn(x)
            best[name] = min(best[name], (time.perf_counter() - start) / calls)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--rows", default="1,4,8")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    results = []
    for out_features, in_features in SHAPES:
        weight = torch.randn(out_features, in_features) * 0.05
        fns = candidates(weight)
        calls = max(2, 2_000_000 // (out_features * in_features))
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, in_features)
            times = best_times(fns, x, calls, args.rounds)
            base = times["float32"]
            line = "  ".join(f"{name} {1e3 * t:.3f} ms ({t / base:.2f}x)" for name, t in times.items())
            print(f"{out_features}x{in_features} rows {rows}: {line}", flush=True)
            results.append({"shape": [out_features, in_features], "rows": rows, "seconds": times})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "torch": torch.__version__, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
