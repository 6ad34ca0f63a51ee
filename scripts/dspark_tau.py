"""Tau of DSpark (chain, and with the prefix scheduler) against DFlash on the same prompts: greedy,
the target's own text, one torch thread. Prints a JSON line per drafter and whether every output
equals plain greedy decoding (the lossless check).

    python scripts/dspark_tau.py --head outrider/heads/shipped/dspark/smollm2-135m-instruct \
        --dflash smollm2-135m-instruct --prompts 4 --max-new-tokens 64

tau = committed tokens / rounds over all prompts (bonus included); the chain is gamma drafts for
DSpark (every block slot a prediction) and B-1 for DFlash (the controller fixed at that depth).
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--head", required=True, help="DSpark head folder or shipped name")
    ap.add_argument("--dflash", default="smollm2-135m-instruct", help="DFlash head to compare against")
    ap.add_argument("--workload", default="humaneval")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--runs", default="dflash,chain,schedule", help="which of dflash, chain, schedule to run")
    ap.add_argument("--one-at-a-time", action="store_true", help="generate the prompts one by one (a batch of 1: "
                    "the scheduler's verify starts at 1 token, not at the batch's size)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from outrider.bench.workloads import load_workload
    from outrider.llm import LLM

    texts = [p.text for p in load_workload(args.workload, limit=args.prompts).prompts]
    plain = [c.token_ids for c in LLM(args.target, dtype="float32").generate(texts, args.max_new_tokens)]
    from outrider.heads.catalog import resolve_head
    from outrider.heads.dflash.format import read_config as dflash_config
    from outrider.heads.dspark.format import read_config as dspark_config

    gamma = dspark_config(resolve_head(args.head, "dspark")).gamma
    block = dflash_config(resolve_head(args.dflash, "dflash")).block_size
    runs = {"dflash": (f"dflash:{args.dflash}", block - 1), "chain": (f"dspark:{args.head}", gamma),
            "schedule": (f"dspark:{args.head},schedule=on", gamma)}
    runs = [runs[name] for name in args.runs.split(",")]
    for drafter, depth in runs:
        llm = LLM(args.target, drafter=drafter, controller=f"fixed:{depth}", dtype="float32")
        began = time.perf_counter()
        done = ([llm.generate(t, args.max_new_tokens) for t in texts] if args.one_at_a_time
                else llm.generate(texts, args.max_new_tokens))
        seconds = time.perf_counter() - began
        rounds = sum(c.round_stats.rounds for c in done)
        committed = sum(c.round_stats.committed for c in done)
        drafted = sum(c.round_stats.drafted for c in done)
        print(json.dumps({"drafter": drafter, "depth": depth, "batch": 1 if args.one_at_a_time else len(texts), "prompts": len(texts), "rounds": rounds,
                          "committed": committed, "drafted": drafted, "tau": round(committed / max(rounds, 1), 3),
                          "seconds": round(seconds, 2), "equal_to_plain": [c.token_ids for c in done] == plain}),
              flush=True)


if __name__ == "__main__":
    main()
