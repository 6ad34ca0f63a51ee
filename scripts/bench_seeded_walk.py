"""What the same-seed promise costs: tau of rejection sampling against the seeded walk with
coupled drafts, for sampled chains (docs/usage.md#seeds, issue 38).

    python scripts/bench_seeded_walk.py [--model smollm2-135m-instruct]
           [--drafters eagle3:smollm2-135m-instruct,draft-model:smollm2-135m-instruct@q4_0]
           [--depth 4] [--workload humaneval] [--prompts 4] [--max-new-tokens 64]
           [--temperatures 0.7,1.0] [--seed 1] [--seeds 2] [--threads 2] [--json OUT]

One process, one engine per drafter and verifier; the same prompts and seeds for each, at a fixed
depth (`fixed:DEPTH`, so tau compares like with like):

    rejection_chain   named (`--verifier rejection_chain`): what an unseeded request gets
    walk, coupled     the seeded default: chain_walk, the drafter drawing its chain with the walk's
                      own uniforms
    walk, apart       chain_walk with the drafter on streams of its own (coupling switched off
                      here by hand): what coupling buys

Reported: tau (committed tokens per round, bonus included) over all prompts and seeds, and
whether each seeded walk's text equals plain sampling's with the same seed (it must).
"""

from __future__ import annotations

import argparse
import json
import sys

from outrider import LLM
from outrider.bench.workloads import load_workload

MODES = ("rejection_chain", "walk, coupled", "walk, apart")


def engine(model: str, drafter: str, depth: int, threads: int, mode: str) -> LLM:
    verifier = "rejection_chain" if mode == "rejection_chain" else None
    llm = LLM(model, drafter=drafter, controller=f"fixed:{depth}", threads=threads, verifier=verifier)
    if mode == "walk, apart":
        llm.speculator.couples = False  # the chain drawn from the drafter's own streams
    return llm


def measure(llm: LLM, texts: list[str], budget: int, temperature: float, seeds: list[int], chat: bool,
            plain: dict) -> dict:
    rounds = committed = 0
    same = True
    for i, text in enumerate(texts):
        for seed in seeds:
            out = llm.generate(text, budget, temperature=temperature, seed=seed, chat=chat)
            rounds += out.stats["rounds"]
            committed += len(out.token_ids)
            same &= out.token_ids == plain[(i, seed)]
    return {"tau": committed / rounds, "rounds": rounds, "tokens": committed, "equals_plain": same}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--drafters", default="eagle3:smollm2-135m-instruct,draft-model:smollm2-135m-instruct@q4_0")
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--workload", default="humaneval")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperatures", default="0.7,1.0")
    ap.add_argument("--seed", type=int, default=1, help="the first seed")
    ap.add_argument("--seeds", type=int, default=2, help="seeds per prompt: --seed, --seed + 1, ...")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    workload = load_workload(args.workload, limit=args.prompts, max_new_tokens=args.max_new_tokens)
    texts = [p.text if p.text is not None else p.messages[-1]["content"] for p in workload.prompts]
    seeds = list(range(args.seed, args.seed + args.seeds))
    temperatures = [float(t) for t in args.temperatures.split(",")]
    base = LLM(args.model, threads=args.threads)
    plain = {t: {(i, s): base.generate(x, args.max_new_tokens, temperature=t, seed=s, chat=workload.chat).token_ids
                 for i, x in enumerate(texts) for s in seeds} for t in temperatures}
    results = {"model": args.model, "depth": args.depth, "workload": args.workload, "prompts": len(texts),
               "max_new_tokens": args.max_new_tokens, "seeds": seeds, "runs": []}
    for drafter in args.drafters.split(","):
        for mode in MODES:
            llm = engine(args.model, drafter, args.depth, args.threads, mode)
            for t in temperatures:
                row = measure(llm, texts, args.max_new_tokens, t, seeds, workload.chat, plain[t])
                row.update(drafter=drafter, mode=mode, temperature=t)
                results["runs"].append(row)
                print(f"{drafter:44s} T={t:<4} {mode:16s} tau {row['tau']:.3f}  ({row['rounds']} rounds, "
                      f"{row['tokens']} tokens)  text == plain sampling's: {row['equals_plain']}", flush=True)
            del llm
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
