"""Pipeline-sharded speculation (seed #8) against hop latency and K, as the paper measures it.

    .venv/bin/python scripts/bench_pipeline.py --stages 2 --hops 0,20,50,100 --ks 2,4,8 --tokens 32
    .venv/bin/python scripts/bench_pipeline.py --draft suffix --streams 2 --micro-batches 2 ...

The target (SmolLM2-135M at --dtype, q8_0 by default: the native layer) on --stages Ray actors of
one thread each, the draft model (--draft, SmolLM2's q4 copy by default) on this process, the
coordinator. For each simulated hop latency (ms a link crossing; a traversal crosses N links)
and K (fixed:K chains), greedy, one stream: tokens/s and the speed-up over autoregressive
decoding through the same pipeline at that hop latency; every run's tokens are checked equal to
one process's. One process's own AR and speculative runs (no pipeline, no hops) are interleaved
with each hop latency's, as the baseline on a shared machine. --streams N decodes N prompts at
once (tokens/s over all of them), --micro-batches 1,2 sends them down the stages in 1, then 2
groups (the same stages, interleaved).
Prints one JSON line a run and a table."""

from __future__ import annotations

import argparse
import json
import time

import torch


PROMPTS = ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "def is_prime(n):\n    \"\"\"Return True when n is a prime number.\"\"\"\n",
           "def reverse_words(text):\n    \"\"\"Return the words of text in reverse order.\"\"\"\n"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="q8_0")
    ap.add_argument("--draft", default="draft-model:smollm2-135m-instruct@q4")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--hops", default="0,20,50,100")
    ap.add_argument("--ks", default="2,4,8")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rewind", default="trim")
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--micro-batches", default="1", help="comma list: each setting run in turn on the same stages")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from outrider.cluster.pipeline_llm import split_llm
    from outrider.engine.speculator import SpecOptions, Speculator
    from outrider.llm import LLM

    prompts = PROMPTS[: args.streams]
    ks = list(map(int, args.ks.split(",")))
    one = LLM(args.model, dtype=args.dtype, threads=1)
    mono_specs = {0: None, ks[-1]: Speculator.build(SpecOptions(args.draft, "chain", f"fixed:{ks[-1]}", 256, None).check(),
                                                    one.target, one.path)}
    expected = [c.token_ids for c in one.generate(prompts, args.tokens)]
    llm = LLM(args.model, dtype=args.dtype, threads=1)
    split_llm(llm, args.stages, transport="ray", rewind=args.rewind, dtype=args.dtype, threads=1)
    micro = list(map(int, args.micro_batches.split(",")))
    target = llm.target
    specs = {0: None}
    for k in ks:
        specs[k] = Speculator.build(SpecOptions(args.draft, "chain", f"fixed:{k}", 256, None).check(), target, llm.path)
    llm.speculator = specs[ks[-1]]
    llm.generate(prompts, 8)  # warm: the stages' first forwards, the draft's
    rows = []

    def timed(model, spec, where, hop, k, ar, mb=1):
        model.speculator = spec
        target.micro_batches = mb
        before = target.traversals
        start = time.perf_counter()
        out = [c.token_ids for c in model.generate(prompts, args.tokens)]
        seconds = time.perf_counter() - start
        assert out == expected, f"{where} hop {hop} K {k}: tokens differ from one process's"
        rate = len(prompts) * args.tokens / seconds
        row = dict(where=where, hop_ms=hop, k=k, mb=mb if where == "pipeline" else None, tok_s=round(rate, 2), speedup=round(rate / (ar or rate), 2),
                   traversals=target.traversals - before if where == "pipeline" else None, seconds=round(seconds, 2))
        print(json.dumps(row), flush=True)
        rows.append(row)
        return rate

    for hop in map(float, args.hops.split(",")):
        mono_ar = timed(one, None, "one process", 0, 0, None)
        timed(one, mono_specs[ks[-1]], "one process", 0, ks[-1], mono_ar)
        target.set_hop(hop)
        for mb in micro:
            ar = None
            for k, spec in specs.items():
                rate = timed(llm, spec, "pipeline", hop, k, ar, mb)
                ar = rate if k == 0 else ar
    print(f"| where | hop ms | K | micro-batches | tok/s ({len(prompts)} streams) | x AR (same pipeline / process) "
          "| traversals |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['where']} | {r['hop_ms']:g} | {r['k'] or 'AR'} | {r['mb'] or '-'} | {r['tok_s']} | {r['speedup']} | "
              f"{r['traversals'] if r['traversals'] is not None else '-'} |")
    target.close()


if __name__ == "__main__":
    main()
