"""One mixture-of-experts MLP (models/moe_layer.py, the plain torch reference) at Qwen3-Next-80B-A3B's
expert shapes (hidden 2048, routed experts of 512, top 10, a shared expert of 512, its gate) with
fewer routed experts than its 512 (--experts, memory), weights q8_0 (multiplied by the native
kernel, as `--dtype q8_0` loads them) or float32, random weights and rows.

For k rows (a verify of k tokens) it measures one forward of the k rows against k one-row
forwards (k decode steps), interleaved round by round, in thread CPU time, medians over rounds,
and counts the distinct experts the k rows choose: what a k-token verify reads once. The ratio is
the baseline a grouped expert kernel (issue 41) is measured against.

    .venv/bin/python scripts/bench_moe_layer.py [--experts 64] [--dtype q8_0] [--rounds 7] [--seed 0]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from outrider.kernels.blocks import quantize
from outrider.kernels.quant_linear import QuantLinear, choose_kernel
from outrider.models.moe_config import MoeConfig
from outrider.models.moe_layer import MoeWeights, moe_mlp, route

HIDDEN, EXPERT, SHARED, TOP_K = 2048, 512, 512, 10  # Qwen3-Next-80B-A3B's config.json


def weights(experts: int, dtype: str, seed: int) -> MoeWeights:
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g) * 0.02  # noqa: E731
    keep = (lambda w: QuantLinear(quantize(w, "q8_0"), torch.float32, choose_kernel(quantize(w, "q8_0")))) \
        if dtype == "q8_0" else (lambda w: w)
    return MoeWeights(router=torch.randn(experts, HIDDEN, generator=g) * HIDDEN ** -0.5,
                      gate_up=[keep(rand(2 * EXPERT, HIDDEN)) for _ in range(experts)],
                      down=[keep(rand(HIDDEN, EXPERT)) for _ in range(experts)],
                      shared_gate_up=keep(rand(2 * SHARED, HIDDEN)), shared_down=keep(rand(HIDDEN, SHARED)),
                      shared_gate=rand(1, HIDDEN))


def timed(fn) -> float:
    """The thread's CPU seconds for fn() (one torch thread: steadier than wall time on shared cores)."""
    start = time.thread_time()
    fn()
    return time.thread_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--dtype", choices=("q8_0", "float32"), default="q8_0")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    w = weights(args.experts, args.dtype, args.seed)
    cfg = MoeConfig(args.experts, TOP_K, EXPERT, True, SHARED, True)
    x = torch.randn(1, 16, HIDDEN, generator=torch.Generator().manual_seed(args.seed + 1))  # [1, 16, E]
    with torch.inference_mode():
        moe_mlp(w, cfg, x[:, :2])  # warm-up
        print(f"experts {args.experts}, top {TOP_K}, hidden {HIDDEN}, expert {EXPERT}, shared {SHARED}, "
              f"{args.dtype}, 1 thread, {args.rounds} rounds (medians)")
        print("| rows k | distinct experts | one forward of k rows (CPU ms) | k one-row forwards (CPU ms) | ratio |")
        print("|---|---|---|---|---|")
        for k in (1, 2, 4, 8, 16):
            rows = x[:, :k]
            distinct = len(set(route(rows[0], w.router, cfg)[1].reshape(-1).tolist()))
            batch, steps = [], []
            for _ in range(args.rounds):
                batch.append(timed(lambda: moe_mlp(w, cfg, rows)))
                steps.append(sum(timed(lambda: moe_mlp(w, cfg, rows[:, i:i + 1])) for i in range(k)))
            b, s = statistics.median(batch) * 1e3, statistics.median(steps) * 1e3
            print(f"| {k} | {distinct} | {b:.2f} | {s:.2f} | {b / s:.2f} |")


if __name__ == "__main__":
    main()
