"""One RL rollout batch on real replicas: its makespan under least-load and under TailSieve.

For each setup (`--setup POLICY`, repeated; `POLICY/plain` sends `speculate: false` with every
request: the same policy with no request speculating) the script starts `outrider serve
--replicas N --threads T --policy POLICY` on a free port (scripts/bench_cluster.py's start and
stop), warms every replica up, then sends one rollout batch and stops the server:

  - `--prompts` HumanEval prompts (the bench's, as bench_cluster.py sends them) x `--samples`
    samples each, temperature `--temperature` (1), sample i's `seed` = `--seed` x 1000 + i,
    `max_tokens` = `--max-tokens`, streamed;
  - every request carries the same `X-Rollout-Group` header (what TailSieve groups by);
  - all of them submitted at once (asyncio tasks), at most `--client-concurrency` connections
    open (default: the whole batch, so the router sees the whole group at once: TailSieve sizes a
    group by the requests routed so far).

The warm-up is a group of its own (`warmup-<setup>`), four requests of 4, 8, 48 and 48 tokens:
under least-load they land on both replicas; under `tailsieve:fast=1` they go to the bulk
replica and, once two have ended, the other two are moved to the low-latency one if they still
run then, so that it too has run before the timed batch. Moves are counted from /metrics
(`outrider:cluster_requests_moved_total`, summed over replicas and reasons) before and after
the batch, so the warm-up's are not in the figure.

Per setup it reports the makespan (first submit to last completion), the requests' output
lengths (p50, p99, max, how many reached the cap) and end times, output tokens/s over the
makespan, tau where requests speculated, moves, errors and lost requests, and the load average
(1 min) before the warm-up and after the batch. Setups run one after another: on a shared
machine each sees different background load, so alternate them and run each more than once.

    .venv/bin/python scripts/bench_cluster_rollout.py --drafter suffix --prompts 4 --samples 4 \\
        --max-tokens 256 --max-running 8 --setup least-load --setup tailsieve:fast=1 \\
        --setup tailsieve:fast=1/plain --setup least-load --setup tailsieve:fast=1 --setup tailsieve:fast=1/plain

What it measured on 2 replicas of 2 cores: docs/scheduling.md (TailSieve).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cluster import start, stop  # noqa: E402  (scripts/ is not a package)

from outrider.bench.serve_load import Record, Target, percentiles, records_json, send  # noqa: E402
from outrider.bench.serve_run import LoadPlan, load_prompts  # noqa: E402

GROUP_HEADER = "X-Rollout-Group"
MOVED = re.compile(r'^outrider:cluster_requests_moved_total\{([^}]*)\}\s+(\S+)', re.M)
WARMUP_TOKENS = (4, 8, 48, 48)


@dataclass
class RolloutTarget(Target):
    """Request i is sample i % samples of prompt i // samples, sampled with its own seed."""

    samples: int = 1
    temperature: float = 1.0
    seed: int = 0
    plain: bool = False

    def prompt_index(self, index: int) -> int:
        return (self.offset + index // self.samples) % len(self.prompts)

    def body(self, index: int) -> dict:
        body = super().body(index)
        body.update(temperature=self.temperature, seed=self.seed * 1000 + index)
        if self.plain:
            body["speculate"] = False
        return body


def moved_in(text: str) -> float:
    """outrider:cluster_requests_moved_total in a /metrics text, summed over its per-replica series."""
    return sum(float(v) for labels, v in MOVED.findall(text) if "replica=" in labels)


def moved_total(url: str) -> float:
    return moved_in(httpx.get(url + "/metrics", timeout=30).text)


async def batch(target: Target, n: int, group: str, connections: int) -> tuple[list[Record], float]:
    """All n requests at once, `connections` at most in flight; the records and the batch's t0."""
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    timeout = httpx.Timeout(target.request_timeout, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, headers={GROUP_HEADER: group}) as client:
        t0 = time.perf_counter()
        records = await asyncio.gather(*(send(client, target, i, t0) for i in range(n)))
    return list(records), t0


def warmup(url: str, prompts, chat: bool, group: str) -> list[Record]:
    """WARMUP_TOKENS' requests at once, one group, the workload's last prompts (not the batch's)."""
    targets = [RolloutTarget(url, prompts, chat, tokens, offset=len(prompts) - 1 - i, seed=999)
               for i, tokens in enumerate(WARMUP_TOKENS)]

    async def go():
        async with httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=30.0),
                                     headers={GROUP_HEADER: group}) as client:
            t0 = time.perf_counter()
            return await asyncio.gather(*(send(client, t, 0, t0) for t in targets))

    return list(asyncio.run(go()))


def figures(records: list[Record], max_tokens: int) -> dict:
    ok = [r for r in records if r.outcome == "ok"]
    lengths = [r.output_tokens for r in ok]
    ends = [r.end for r in records if r.end is not None]
    makespan = max(ends) - min(r.sent for r in records) if ends else None
    tokens, rounds = sum(lengths), sum(r.rounds for r in ok)
    drafted = sum(r.drafted for r in ok)
    return {"requests": len(records), "ok": len(ok), "errors": sum(r.outcome == "error" for r in records),
            "lost": sum(r.outcome == "lost" for r in records),
            "error_messages": sorted({r.error for r in records if r.error})[:5],
            "makespan_s": makespan, "output_tokens_total": tokens,
            "throughput_tok_s": tokens / makespan if makespan else None,
            "output_tokens": {**percentiles([float(x) for x in lengths]), "min": min(lengths, default=None),
                              "max": max(lengths, default=None),
                              "at_cap": sum(x >= max_tokens for x in lengths)},
            "end_s": percentiles([r.end for r in ok]),
            "tau": tokens / rounds if rounds else None,
            "speculated_requests": sum(r.drafted > 0 for r in ok),
            "acceptance": sum(r.accepted for r in ok) / drafted if drafted else None,
            "finish_reasons": {k: sum(r.finish_reason == k for r in ok)
                               for k in sorted({r.finish_reason for r in ok})}}


def run_setup(k: int, setup: str, args, prompts, chat: bool) -> dict:
    policy, _, mode = setup.partition("/")
    if mode not in ("", "plain"):
        sys.exit(f"--setup {setup!r}: after the policy only '/plain' may follow")
    extra = ["--replicas", str(args.replicas), "--policy", policy]
    if args.controller:
        extra += ["--controller", args.controller]
    load_before = os.getloadavg()
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    proc, url = start(extra, args, args.out.with_suffix(f".{k}.log"), max_running=args.max_running)
    try:
        warm = warmup(url, prompts, chat, f"warmup-{k}")
        time.sleep(1.0)  # the warm-up's moves and counters settle
        before = moved_total(url)
        target = RolloutTarget(url, prompts[:args.prompts], chat, args.max_tokens, samples=args.samples,
                               temperature=args.temperature, seed=args.seed, plain=mode == "plain",
                               request_timeout=args.request_timeout)
        n = args.prompts * args.samples
        load_batch = os.getloadavg()
        records, _ = asyncio.run(batch(target, n, f"rollout-{k}", args.client_concurrency or n))
        time.sleep(1.0)
        moves = moved_total(url) - before
    finally:
        status = stop(proc)
    result = figures(records, args.max_tokens)
    result.update(setup=setup, run=k, started=started, command=" ".join(extra), moves=moves, exit_status=status,
                  load_average_before=list(load_before), load_average_batch=list(load_batch),
                  load_average_after=list(os.getloadavg()),
                  warmup_ok=sum(r.outcome == "ok" for r in warm), records=records_json(records))
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setup", action="append", required=True,
                        help="POLICY (as --policy) or POLICY/plain; repeat to alternate, e.g. least-load, "
                             "tailsieve:fast=1")
    parser.add_argument("--model", default=None)
    parser.add_argument("--drafter", default=None, help="as for outrider serve (TailSieve's fast set needs one)")
    parser.add_argument("--controller", default=None,
                        help="as for outrider serve (default: its own, cost; fixed:4 drafts every round)")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    parser.add_argument("--max-running", type=int, default=8, help="slots per replica")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--client-concurrency", type=int, default=0, help="connections (0: the whole batch)")
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--out", type=Path, default=Path("cluster-rollout.json"))
    args = parser.parse_args()
    args.concurrency = args.max_running  # what bench_cluster.start reads when not told
    prompts, chat, _ = load_prompts(LoadPlan(model=args.model))
    if args.prompts > len(prompts):
        sys.exit(f"--prompts {args.prompts}: the workload has {len(prompts)}")
    results = []
    for k, setup in enumerate(args.setup):
        r = run_setup(k, setup, args, prompts, chat)
        results.append(r)
        o = r["output_tokens"]
        tau = f"{r['tau']:.2f}" if r["tau"] else "-"
        print(f"{k} {setup:<28} makespan {r['makespan_s']:6.1f} s  {r['throughput_tok_s']:5.1f} tok/s  "
              f"len p50 {o['p50']:.0f} p99 {o['p99']:.0f} min {o['min']} max {o['max']} at cap {o['at_cap']}  "
              f"tau {tau}  moves {r['moves']:.0f}  ok {r['ok']} errors {r['errors']} lost {r['lost']}  "
              f"load {r['load_average_before'][0]:.2f}/{r['load_average_after'][0]:.2f}", flush=True)
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                        "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
