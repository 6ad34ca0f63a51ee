"""Batched drafting, before and after: the same generation on two checkouts of Outrider, in one run.

Each measurement is a fresh process (`PYTHONPATH` = the checkout, this venv's python), so two
versions of the code run the same prompts on the same machine, interleaved: B HumanEval prompts
(the bench's workload) generated together with `LLM.generate`, greedy, a fixed thread count.
Prints wall time, output tokens/s and the time drafting took (the requests' draft_s), per
checkout and batch size, and each checkout's ratio to the first; checks that every checkout
gave the same tokens.

    git worktree add /tmp/wt-before <commit>
    .venv/bin/python scripts/bench_batched_drafting.py --checkouts before=/tmp/wt-before,after=. \\
        --drafter early-exit:8 --controller fixed:3 --batch 1,16
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

INNER = r"""
import json, sys, time
from outrider import LLM
from outrider.bench.workloads import load_workload
a = json.loads(sys.argv[1])
llm = LLM(a["model"], drafter=a["drafter"], controller=a["controller"], tree=a["tree"], threads=a["threads"])
texts = [p.text for p in load_workload("humaneval", limit=a["batch"]).prompts]
llm.generate(texts[:1], max_new_tokens=4)  # warm-up
start = time.perf_counter()
out = llm.generate(texts, max_new_tokens=a["new_tokens"])
wall = time.perf_counter() - start
print(json.dumps({"wall": wall, "tokens": sum(len(c.token_ids) for c in out),
                  "draft_s": sum(c.stats["draft_s"] for c in out), "verify_s": sum(c.stats["verify_s"] for c in out),
                  "ids": [c.token_ids for c in out]}))
"""


def measure(checkout: Path, args, batch: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(checkout))
    spec = dict(model=args.model, drafter=args.drafter, controller=args.controller, tree=args.tree,
                threads=args.threads, batch=batch, new_tokens=args.new_tokens)
    out = subprocess.run([sys.executable, "-c", INNER, json.dumps(spec)], env=env, cwd=checkout,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkouts", required=True, help="NAME=PATH,NAME=PATH (the first is the baseline)")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--drafter", default="early-exit:8")
    ap.add_argument("--controller", default="fixed:3")
    ap.add_argument("--tree", default="chain")
    ap.add_argument("--batch", default="1,16", help="prompts generated together, comma-separated")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2, help="interleaved runs per checkout and batch")
    args = ap.parse_args(argv)
    checkouts = [(n, Path(p).resolve()) for n, p in (c.split("=", 1) for c in args.checkouts.split(","))]
    print(f"{args.model} {args.drafter} {args.tree} {args.controller}, {args.new_tokens} new tokens, "
          f"{args.threads} thread(s), load average {os.getloadavg()[0]:.2f} at the start", flush=True)
    for batch in [int(b) for b in args.batch.split(",")]:
        runs: dict[str, list[dict]] = {name: [] for name, _ in checkouts}
        for _ in range(args.repeats):
            for name, path in checkouts:
                runs[name].append(measure(path, args, batch))
        digests = {name: hashlib.sha256(json.dumps(r[0]["ids"]).encode()).hexdigest()[:12] for name, r in runs.items()}
        base = statistics.median(r["wall"] for r in runs[checkouts[0][0]])
        for name, _ in checkouts:
            wall = statistics.median(r["wall"] for r in runs[name])
            draft = statistics.median(r["draft_s"] for r in runs[name])
            tokens = runs[name][0]["tokens"]
            each = ", ".join(f"{r['wall']:.2f}" for r in runs[name])
            print(f"batch {batch:3d} {name:>8}: wall {wall:7.2f} s (runs {each}),"
                  f" {tokens / wall:6.1f} tok/s, draft_s {draft:7.2f}, {base / wall:5.2f}x the {checkouts[0][0]}'s speed,"
                  f" ids {digests[name]}", flush=True)
        if len(set(digests.values())) > 1:
            print(f"batch {batch}: the checkouts gave different tokens", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
