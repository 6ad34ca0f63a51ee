"""A prefill's projections: matmul_amx.c's tile kernel against the float GEMM it replaces (and, for a
drafter's lossy prefill, its one-part form against oneDNN's bfloat16 GEMM), on the Qwen 1.5B's
and SmolLM2's shapes.

    .venv/bin/python scripts/bench_fill.py [--threads 2] [--rows 256] [--rounds 5]

Each candidate is timed in rounds that alternate them (a burst of load elsewhere hits all), the
best round counts; printed: milliseconds per call and the speed-up over the float GEMM on the
same weight, and each one's largest error against float64, relative to the largest output. Needs
a CPU with AMX (the tile unit) and the native kernel; elsewhere it says so and stops.
"""

from __future__ import annotations

import argparse
import time

import torch

# (kind, in, out): the 1.5B's gate/up and down (q4_1 from Q4_K, q8_16 from Q6_K), qkv; SmolLM2's gate/up
SHAPES = [("q4_1", 1536, 17920), ("q4_1", 8960, 1536), ("q8_16", 8960, 1536), ("q8_0", 1536, 2048),
          ("q4_1", 576, 3072)]


def weight(kind: str, cols: int, rows: int):
    from outrider.kernels import native
    from outrider.kernels.blocks import QuantBlocks, quantize

    g = torch.Generator().manual_seed(rows + cols)
    if kind == "q8_16":  # as quant_convert keeps a Q6_K: codes -32..31, a scale per 16 values
        blocks = QuantBlocks("q8_16", torch.randint(-32, 32, (rows, cols), generator=g, dtype=torch.int8),
                             torch.rand(rows, cols // 16, generator=g) * 1e-3)
    else:
        blocks = quantize(torch.randn(rows, cols, generator=g) * 0.05, kind)
    return native.NativeWeight.of(blocks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from outrider.kernels import native, quant_linear

    if not native.amx_available():
        raise SystemExit("matmul_amx.c's tile kernel does not run here (no AMX, or the native kernel is not built)")
    quant_linear._BF16_PREFILL[0] = False
    for kind, cols, rows in SHAPES:
        w = weight(kind, cols, rows)
        x = torch.randn(args.rows, cols, generator=torch.Generator().manual_seed(1))
        state = {"weight": w}

        def gemm(bf16: bool = False):
            quant_linear._TILE_PREFILL[0] = False  # the path matmul_amx.c replaced
            with quant_linear.filling(True, bf16=bf16):
                return quant_linear._matmul_native(x, state)

        runs = {"float GEMM": gemm, "tiles": lambda: native.amx_matmul(x, w),
                "oneDNN bf16 (lossy)": lambda: gemm(True), "tiles, 1 part (lossy)": lambda: native.amx_matmul(x, w, True)}
        best = {name: float("inf") for name in runs}
        for _ in range(args.rounds):
            for name, run in runs.items():
                run()
                start = time.perf_counter()
                run()
                best[name] = min(best[name], time.perf_counter() - start)
        exact = x.double() @ native.dequantize_rows(w, 0, rows).double().T
        scale = exact.abs().max().item()
        parts = [f"{name} {best[name] * 1e3:.1f} ms ({best['float GEMM'] / best[name]:.2f}x, "
                 f"err {(run().double() - exact).abs().max().item() / scale:.1e})" for name, run in runs.items()]
        print(f"{kind} {args.rows} x {cols} x {rows}: " + " | ".join(parts))
    quant_linear._TILE_PREFILL[0] = None


if __name__ == "__main__":
    main()
