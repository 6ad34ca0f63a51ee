"""The native layer over paged K/V: pages read in place against the span copied out (issue 42, item 1).

    .venv/bin/python scripts/bench_paged_read.py --batch 8 --context 512,1536 --rounds 7 --threads 1

One target (SmolLM2-135M q4 by default), `--batch` slots each prefilled with `--context` tokens into
a slot cache and into a paged cache (prefilled 64 rows a slot a forward, so that each slot's pages
are runs of four with the other slots' between them). Then decode steps (one token a slot) and verify forwards (a chain of `--verify` tokens
a slot), each timed as the median of `--rounds` rounds, the arms interleaved in every round: slots,
paged in place (the kernel reads the pages through the row map), paged copy (the reference:
each layer's span copied out in slot layout and written back). Every step writes the same rows
again, so the context stays `--context`. Printed per context: milliseconds a step per arm, the
ratios in the same run, whether the logits are bit-equal across arms, and the memory each paged
read holds beyond the pool (the copy's two span buffers, the row map).
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
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", default="512,1536")
    ap.add_argument("--verify", type=int, default=4, help="tokens a slot in the verify forward")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from outrider import LLM
    from outrider.models.batch import pack

    llm = LLM(args.model, threads=args.threads)
    target = llm.target
    B = args.batch
    llm.generate("warm up", 1)  # the native layer is chosen at the first forward
    print(json.dumps({"model": args.model, "threads": args.threads, "batch": B, "page_rows": args.page,
                      "native_layer": target._native is not None}), flush=True)
    gen = torch.Generator().manual_seed(0)
    for context in (int(c) for c in args.context.split(",")):
        max_len = context + args.verify + 8
        pages = B * (-(-max_len // args.page) + 1) + 8
        slots = target.new_cache(B, max_len)
        paged = target.new_cache(B, max_len, pages=pages, page_size=args.page)
        prompts = [torch.randint(3, 4000, (context,), generator=gen) for _ in range(B)]
        for start in range(0, context, 64):  # prefilled 64 rows a slot a forward: pages interleaved
            for cache in (slots, paged):
                piece = [p[start:start + 64] for p in prompts]
                target.forward(pack(list(range(B)), [start] * B, piece, logits="none", scratch_row=cache.scratch_row),
                               cache)
        for cache in (slots, paged):
            for s in range(B):
                cache.set_length(s, context)
        steps = {"decode": [torch.randint(3, 4000, (1,), generator=gen) for _ in range(B)],
                 "verify": [torch.randint(3, 4000, (args.verify,), generator=gen) for _ in range(B)]}
        for kind, tokens in steps.items():
            times = {"slots": [], "paged-in-place": [], "paged-copy": []}
            logits = {}
            for _ in range(args.rounds):
                for arm in times:
                    cache = slots if arm == "slots" else paged
                    if cache is paged:
                        paged.read_in_place = arm == "paged-in-place"
                    batch = pack(list(range(B)), [context] * B, tokens, scratch_row=cache.scratch_row)
                    t0 = time.perf_counter()
                    out = target.forward(batch, cache).logits
                    times[arm].append(time.perf_counter() - t0)
                    logits[arm] = out
            equal = all(torch.equal(logits["slots"], v) for v in logits.values())
            ms = {arm: round(1000 * statistics.median(t), 2) for arm, t in times.items()}
            held = {"copy_buffers_mib": round(sum(b.numel() * b.element_size() for b in paged._copy) / (1 << 20), 2),
                    "row_map_kib": round(paged._rowmap[1].numel() * 8 / 1024, 1)}
            print(json.dumps({"context": context, "step": kind, "rows": B * tokens[0].numel(), "ms": ms,
                              "in_place_vs_copy": round(ms["paged-copy"] / ms["paged-in-place"], 3),
                              "in_place_vs_slots": round(ms["slots"] / ms["paged-in-place"], 3),
                              "logits_bit_equal": equal, **held, "pool_mib": round(paged.nbytes() / (1 << 20), 1)}),
                  flush=True)


if __name__ == "__main__":
    main()
