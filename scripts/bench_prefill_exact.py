"""Is the prefill the same bits in any chunks, and what does the exact path cost? (issue 42, item 3)

    .venv/bin/python scripts/bench_prefill_exact.py --tokens 128,256,512 --rounds 3 --threads 1

One target (SmolLM2-135M q4 by default). For each prefill path (config gemm_prefill on: the torch
layers with the float GEMM from 96 rows, Intel's default; off: the native layer, its products in
the fill kernel), a prompt of the largest size is prefilled whole and in chunks (two splits, one
of them at a 16-token block edge as a prefix-cache restore makes), and every layer's K/V rows are
compared bit for bit with the whole prefill's. Then each size is prefilled whole, the paths
interleaved in every round, and the median seconds and tokens a second are printed with the
ratio native / GEMM in the same run. Last, torch's float GEMM alone on the model's product shapes
(random float32 rows and weights): whether a row's result depends on how many rows the call
holds, at one and at two threads (`--gemm-rows`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tokens", default="128,256,512")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--gemm-rows", action="store_true", help="only the GEMM row probe")
    args = ap.parse_args()
    if args.gemm_rows:
        gemm_rows()
        return
    torch.set_num_threads(args.threads)
    from outrider import LLM
    from outrider.config import overriding
    from outrider.models.batch import pack

    llm = LLM(args.model, threads=args.threads)
    target = llm.target
    llm.generate("warm up", 1)
    sizes = [int(t) for t in args.tokens.split(",")]
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 4000, (max(sizes),), generator=gen)
    n = len(prompt)

    def fill(cache, pieces) -> None:
        start = 0
        for piece in pieces:
            target.forward(pack([0], [start], [prompt[start:start + piece]], logits="none",
                                scratch_row=cache.scratch_row), cache)
            start += piece

    paths = {"gemm": {"gemm_prefill": "on", "amx_prefill": False}, "native": {"gemm_prefill": "off", "amx_prefill": False}}
    splits = [[n], [n // 2 + 7, n - n // 2 - 7], [16 * (n // 32), n - 16 * (n // 32)]]
    for name, config in paths.items():
        with overriding(**config):
            rows = []
            for pieces in splits:
                cache = target.new_cache(1, n + 8)
                fill(cache, pieces)
                rows.append([t[0, :, :n].clone() for t in (*cache.k, *cache.v)])
            same = [all(torch.equal(a, b) for a, b in zip(rows[0], r)) for r in rows[1:]]
            worst = max(float((a - b).abs().max()) for r in rows[1:] for a, b in zip(rows[0], r))
            print(json.dumps({"path": name, "path_label": target.prefill_path(
                pack([0], [0], [prompt], logits="none")).label, "splits": splits[1:], "kv_bit_equal_to_whole": same,
                "max_abs_diff": worst}), flush=True)
    times = {(name, s): [] for name in paths for s in sizes}
    for _ in range(args.rounds):
        for s in sizes:
            for name, config in paths.items():
                with overriding(**config):
                    cache = target.new_cache(1, s + 8)
                    t0 = time.perf_counter()
                    target.forward(pack([0], [0], [prompt[:s]], logits="none", scratch_row=cache.scratch_row), cache)
                    times[(name, s)].append(time.perf_counter() - t0)
    for s in sizes:
        med = {name: statistics.median(times[(name, s)]) for name in paths}
        print(json.dumps({"tokens": s, "seconds": {k: round(v, 3) for k, v in med.items()},
                          "tok_s": {k: round(s / v, 1) for k, v in med.items()},
                          "native_vs_gemm_speed": round(med["gemm"] / med["native"], 3)}), flush=True)


def gemm_rows(shapes=((576, 1728), (576, 3072), (1536, 576))) -> None:
    """A [512, K] x [K, N] product against its rows taken [start, start + M) in a call of their own:
    which (start, M) give other bits, per thread count (SmolLM2's qkv, gate_up, down shapes)."""
    gen = torch.Generator().manual_seed(0)
    cuts = [(0, 96), (0, 128), (0, 135), (16, 121), (128, 128), (135, 121), (0, 300), (5, 300)]
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for K, N in shapes:
            x, w = torch.randn(512, K, generator=gen), torch.randn(N, K, generator=gen)
            whole = x @ w.t()
            differ = [[a, m] for a, m in cuts if not torch.equal(x[a:a + m] @ w.t(), whole[a:a + m])]
            print(json.dumps({"threads": threads, "K": K, "N": N, "row_cuts_differing_from_512_rows": differ}),
                  flush=True)


if __name__ == "__main__":
    main()
