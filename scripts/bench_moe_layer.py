"""One mixture-of-experts MLP (models/moe_layer.py, the plain torch reference) at Qwen3-Next-80B-A3B's
expert shapes (hidden 2048, routed experts of 512, top 10, a shared expert of 512, its gate) with
fewer routed experts than its 512 (--experts, memory), weights q8_0 (multiplied by the native
kernel, as `--dtype q8_0` loads them) or float32, random weights and rows.

For k rows (a verify of k tokens) it measures one forward of the k rows against k one-row
forwards (k decode steps), interleaved round by round, in thread CPU time, medians over rounds,
and counts the distinct experts the k rows choose: what a k-token verify reads once. The ratio is
the baseline a grouped expert kernel (issue 41) is measured against.

    .venv/bin/python scripts/bench_moe_layer.py [--experts 64] [--dtype q8_0] [--rounds 7] [--seed 0]

`--shape qwen3-30b-a3b|mixtral-8x7b|tiny` measures instead what a verify of K tokens costs in one
MoE layer of that model's shapes (random weights, float32 compute, the experts stored as bfloat16 in
a safetensors file, as the checkpoints ship them): distinct experts and bytes per verify for
K = 1, 2, 4, 8, 16 on a random token stream and on a correlated one (x_t = rho x_{t-1} +
sqrt(1 - rho^2) noise: consecutive tokens route alike, as real text does), time per verify with
every expert resident against the same verifies through models/expert_store.py with a quarter of
the experts resident (LRU; `--store direct`: models/slow_tier.py's O_DIRECT reads), and the
break-even tau = cost(K) / cost(1): the tokens a K-token verify must commit to beat AR decoding.
Every K's verifies run on the same tokens (one 16-token span warms the store, then --rounds spans
are timed, wall means: a miss's read waits the thread). Code in verify_cost() below; the shapes are transformers' own config defaults (SHAPES).

    .venv/bin/python scripts/bench_moe_layer.py --shape qwen3-30b-a3b [--store mmap|direct] [--rounds 3]
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


# (hidden, expert size, routed experts, top k): transformers 5.25's Qwen3MoeConfig() defaults (its
# docstring's checkpoint Qwen/Qwen3-30B-A3B-Base) and MixtralConfig() defaults (mistralai/Mixtral-8x7B-v0.1)
SHAPES = {"qwen3-30b-a3b": (2048, 768, 128, 8), "mixtral-8x7b": (4096, 14336, 8, 2), "tiny": (64, 32, 8, 2)}
KS = (1, 2, 4, 8, 16)


def stream(tokens: int, hidden: int, rho: float, seed: int) -> torch.Tensor:
    """[tokens, hidden] rows: independent (rho 0) or x_t = rho x_{t-1} + sqrt(1 - rho^2) noise."""
    noise = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed))
    x = noise.clone()
    for t in range(1, tokens):
        x[t] = rho * x[t - 1] + (1 - rho * rho) ** 0.5 * noise[t]
    return x


def write_experts(path, hidden: int, size: int, experts: int, seed: int) -> list:
    """Random experts saved as bfloat16 (one tensor per projection, the Qwen3-MoE / Mixtral-split
    layout ExpertStore reads); returns the resident float32 (gate_up [2I, H], down [H, I]) list."""
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(seed)
    tensors, name = {}, "model.layers.0.mlp.experts.{}.{}.weight"
    for e in range(experts):
        for proj, shape in (("gate_proj", (size, hidden)), ("up_proj", (size, hidden)), ("down_proj", (hidden, size))):
            tensors[name.format(e, proj)] = (torch.randn(*shape, generator=g) * 0.02).bfloat16()
    save_file(tensors, str(path))
    resident = []
    for e in range(experts):
        gate_up = torch.cat([tensors.pop(name.format(e, "gate_proj")), tensors.pop(name.format(e, "up_proj"))])
        resident.append((gate_up.float(), tensors.pop(name.format(e, "down_proj")).float()))
    return resident


def verify_cost(args) -> None:
    import tempfile
    from pathlib import Path

    from outrider.models.expert_store import ExpertStore
    from outrider.models.slow_tier import DirectStore
    hidden, size, experts, top_k = SHAPES[args.shape]
    experts = min(experts, args.experts or experts)
    cfg = MoeConfig(experts, top_k, size, True)
    router = torch.randn(experts, hidden, generator=torch.Generator().manual_seed(args.seed)) * hidden ** -0.5
    expert_bytes = 3 * hidden * size * 2  # bfloat16, as stored and read
    budget = max(1, experts // 4)
    print(f"{args.shape}: hidden {hidden}, {experts} experts of {size}, top {top_k}, one layer, "
          f"expert {expert_bytes / 2**20:.1f} MiB bf16, float32 compute, 1 thread, store {args.store} "
          f"budget {budget} ({budget / experts:.0%}), wall means over {args.rounds * max(KS)} tokens after "
          f"{max(KS)} warm-up, each K's verifies on the same tokens")
    print("| stream | K | distinct experts / verify | MiB read, all resident | resident ms | store misses / verify"
          " | store MiB read / verify | store ms | tau* resident | tau* store |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = Path(tmp) / "experts.safetensors"
        resident = write_experts(path, hidden, size, experts, args.seed + 2)
        w = MoeWeights(router, [gu for gu, _ in resident], [dn for _, dn in resident])
        make = DirectStore if args.store == "direct" else ExpertStore
        for label, rho in (("random", 0.0), (f"rho {args.rho:g}", args.rho)):
            span = max(KS)  # every K's verifies cover the same tokens: one span warms the store, `rounds` are timed
            n = (1 + args.rounds) * span
            x = stream(n, hidden, rho, args.seed + 1)  # [n, H]
            chosen = route(x, router, cfg)[1]  # [n, top_k]
            base = {}
            for k in KS:
                distinct = statistics.mean(len(set(chosen[i:i + k].reshape(-1).tolist())) for i in range(n - k + 1))
                store = make(path, 1, experts, budget, dtype=torch.float32)
                ws = MoeWeights(router, *store.layer(0))
                res, sto = [], []
                with torch.inference_mode():
                    for start in range(0, n, k):
                        rows = x[start:start + k][None]  # [1, K, H]: successive windows of the stream
                        if start == span:
                            before = store.stats.as_dict()
                        t0 = time.perf_counter()
                        moe_mlp(w, cfg, rows)
                        t1 = time.perf_counter()
                        moe_mlp(ws, cfg, rows)
                        t2 = time.perf_counter()
                        if start >= span:
                            res.append(t1 - t0)
                            sto.append(t2 - t1)
                after = store.stats.as_dict()
                store.close()
                misses = (after["misses"] - before["misses"]) / len(sto)
                read = (after["bytes_read"] - before["bytes_read"]) / len(sto) / 2**20
                rm, sm = statistics.mean(res) * 1e3, statistics.mean(sto) * 1e3
                base.setdefault("r", rm)
                base.setdefault("s", sm)
                print(f"| {label} | {k} | {distinct:.2f} | {distinct * expert_bytes / 2**20:.0f} | {rm:.1f} | "
                      f"{misses:.2f} | {read:.0f} | {sm:.1f} | {rm / base['r']:.2f} | {sm / base['s']:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=None, help="routed experts (default 64; with --shape its own)")
    parser.add_argument("--shape", choices=tuple(SHAPES), default=None, help="verify cost at that model's shapes")
    parser.add_argument("--store", choices=("mmap", "direct"), default="mmap", help="with --shape: how misses read")
    parser.add_argument("--rho", type=float, default=0.9, help="with --shape: the correlated stream's rho")
    parser.add_argument("--dir", default=None, help="with --shape: where the experts' file is written")
    parser.add_argument("--dtype", choices=("q8_0", "float32"), default="q8_0")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.shape is not None:
        return verify_cost(args)
    args.experts = args.experts or 64
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
