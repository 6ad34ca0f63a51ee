"""Validate the simulator against a real run: load `outrider serve [--replicas N]`, then replay it.

    .venv/bin/python scripts/sim_validate.py --replicas 1 --profile profile.json --out val-1
    .venv/bin/python scripts/sim_validate.py --replicas 2 --profile profile.json --out val-2

Starts the server (`--replicas N` on Ray when N > 1, the plain server when N = 1; suffix
drafter, `--threads`, `--max-running` = the largest concurrency), runs closed-loop phases at each
`--concurrency` with speculation off then on (the load test's phases: serve_load.closed_loop,
HumanEval prompts, greedy, fixed max_tokens, fresh prompts each pair), writes results.json in
the load test's shape, then replays every phase in the simulator with N replicas and the
least-load policy (the server's default) and prints real against simulated throughput and
p50 latency (sim/cli.compare_table). The profile must be measured on this machine
(`outrider simulate --measure-profile`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from outrider.bench.serve_load import Target, closed_loop, records_json, summarize
from outrider.bench.serve_run import free_port, load_prompts, LoadPlan
from outrider.cluster.sim.baseline import load_policy
from outrider.cluster.sim.cli import compare_table
from outrider.cluster.sim.costs import load_profile
from outrider.cluster.sim.engine import simulate
from outrider.cluster.sim.report import summarize as sim_summary
from outrider.cluster.sim.workload import from_load_run


def start_server(replicas: int, threads: int, max_running: int, log: Path) -> tuple[subprocess.Popen, str, list]:
    port = free_port()
    cmd = [sys.executable, "-m", "outrider.cli", "serve", "--port", str(port), "--drafter", "suffix",
           "--threads", str(threads), "--max-running", str(max_running)]
    if replicas > 1:
        cmd += ["--replicas", str(replicas)]
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with status {proc.returncode}: see {log}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url, cmd
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise SystemExit(f"the server did not answer /health in 600 s: see {log}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--profile", required=True)
    ap.add_argument("--concurrency", default="1,4,8")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--phase-time", type=float, default=8.0)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    levels = [int(c) for c in args.concurrency.split(",")]
    plan = LoadPlan(max_tokens=args.max_tokens, concurrency=tuple(levels), threads=args.threads)
    prompts, chat, _ = load_prompts(plan)
    load_before = os.getloadavg()
    proc, url, cmd = start_server(args.replicas, args.threads, max(levels), out / "server.log")
    phases = []
    try:
        target = Target(url, prompts, chat, args.max_tokens)
        asyncio.run(closed_loop(target, 1, 2, 30.0, 2))  # warm-up: first-call costs, the cost profile
        target.offset += 2
        for c in levels:
            sent = 0
            for mode in ("off", "on"):
                target.extra = {} if mode == "on" else {"speculate": False}
                records, wall = asyncio.run(closed_loop(target, c, args.requests, args.phase_time, 3))
                s = summarize(records, wall)
                print(f"c={c} spec {mode}: {s['ok']}/{s['requests']} ok, {s['throughput_tok_s']:.1f} tok/s, "
                      f"e2e p50 {s['e2e_s']['p50']:.2f} s", file=sys.stderr, flush=True)
                phases.append({"kind": "closed", "mode": mode, "concurrency": c, "rate": None, **s,
                               "records": records_json(records)})
                sent = max(sent, len(records))
            target.offset += sent
    finally:
        proc.terminate()
        proc.wait(120)
    results = {"plan": {"concurrency": levels, "max_tokens": args.max_tokens, "workload": plan.workload,
                        "chunk_size": plan.chunk_size, "threads": args.threads, "replicas": args.replicas},
               "server_command": cmd, "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "load_average": {"before": list(load_before), "after": list(os.getloadavg())}, "phases": phases}
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    costs = load_profile(args.profile)
    rows = []
    for workload in from_load_run(out / "results.json"):
        s = sim_summary(simulate(workload, load_policy("least-load"), costs, args.replicas), start=0.0)
        rows.append({**s, "measured": workload.measured})
    print(compare_table(rows))
    (out / "compare.md").write_text(compare_table(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
