"""Where qmatmul_fill.c pays: every projection of a model's layers, the row kernel against the fill
kernel (the same bits), by row count, in one process, rounds alternating the two (the best round of
each counts). What `FILL_ROWS` in csrc/qmatmul_fill.c was set from.

    .venv/bin/python scripts/bench_fill_rows.py [--variant avx2] [--threads 1] [--rows 1,2,4,6,8,16,32]
        [--model smollm2-135m-instruct] [--dtype q4] [--head]

`--head` times the output head alone instead (SmolLM2's is Q8_0: what FILL_ROWS_Q8 was set from).
Printed per row count: milliseconds for all the layers' products by each path, and fill / rows
(< 1: the fill kernel is faster).
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", default="auto")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="1,2,3,4,6,8,12,16,24,32")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="q4")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--head", action="store_true", help="the output head alone, not the layers' products")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from outrider.catalog.resolve import resolve_model
    from outrider.kernels import native
    from outrider.weights.loader import load_decoder

    model = load_decoder(resolve_model(args.model), "cpu", args.dtype)
    weights = ([model.lm_head.state["weight"]] if args.head else
               [w.state["weight"] for layer in model.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)])
    if any(w.lanes for w in weights):
        raise SystemExit(f"error: --dtype {args.dtype} multiplies in int8 (one kernel at every count); take a float32-activation dtype")
    with native.use_variant(args.variant):
        print(f"{native.describe()}; {args.model} {args.dtype}, {args.threads} thread(s)")
        for rows in (int(r) for r in args.rows.split(",")):
            xs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
            best = {"rows": float("inf"), "fill": float("inf")}
            for _ in range(args.rounds):
                for path in best:
                    start = time.perf_counter()
                    for w in weights:
                        native.qmatmul(xs[w.shape[1]], w, path)
                    best[path] = min(best[path], time.perf_counter() - start)
            print(f"{rows:4d} rows: row kernel {best['rows'] * 1e3:8.2f} ms, fill kernel {best['fill'] * 1e3:8.2f} ms, "
                  f"fill / rows {best['fill'] / best['rows']:.2f}", flush=True)


if __name__ == "__main__":
    main()
