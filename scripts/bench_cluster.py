"""Replicas against one engine: `outrider serve` alone, `--replicas 1` and `--replicas N` under the same load.

For each setup the script starts `outrider serve` in a subprocess on a free 127.0.0.1 port
(`--threads` CPU threads per engine; a cluster starts its own local Ray and stops it on exit),
sends a few warm-up requests, then runs closed-loop clients (outrider/bench/serve_load.py:
streaming completions of the bench's HumanEval prompts, greedy, `ignore_eos`, fixed
`max_tokens`) for `--phase-time` seconds, and stops the server with SIGTERM. It prints and
writes (`--out`, JSON) output tokens/s, requests/s, TTFT and end-to-end p50/p99, and the
requests that failed or were lost. Setups run one after another, so on a shared machine their
figures see different background load: say so next to them.

    .venv/bin/python scripts/bench_cluster.py --replicas 2 --concurrency 4 --phase-time 40 --threads 1

Loads for the policies' own claims (docs/scheduling.md, "Real"): `--lengths 16,16,16,128` gives
each prompt its own `max_tokens` (by prompt index), so short and long requests queue together
when `--concurrency` exceeds the replicas' `--max-running` slots (OUTLETS); `--sessions S` makes
request n session n mod S (the OpenAI `user` field), re-sending that session's prompt each turn,
an agentic loop whose outputs repeat (WAR); `--max-kv-rows` caps each replica's K/V (BALANCE);
`--rate R` sends Poisson arrivals (open loop) instead of `--concurrency` closed-loop clients.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from outrider.bench.serve_load import Target, closed_loop, open_loop, summarize
from outrider.bench.serve_run import free_port, load_prompts, LoadPlan


@dataclass
class MixTarget(Target):
    """Target with per-prompt `max_tokens` (`lengths[prompt % len]`) and repeating sessions."""

    lengths: tuple[int, ...] = ()
    sessions: int = 0  # > 0: request n is session (offset + n) mod sessions, sending that session's prompt

    def prompt_index(self, index: int) -> int:
        if self.sessions:
            return (self.offset + index) % self.sessions % len(self.prompts)
        return super().prompt_index(index)

    def body(self, index: int) -> dict:
        body = super().body(index)
        if self.lengths:
            body["max_tokens"] = self.lengths[self.prompt_index(index) % len(self.lengths)]
        if self.sessions:
            body["user"] = f"session-{(self.offset + index) % self.sessions}"
        return body


def start(extra: list[str], args, log: Path, max_running: int | None = None) -> tuple[subprocess.Popen, str]:
    """`outrider serve` + `extra` on a free port (args: threads, model, drafter; --max-running is
    `max_running`, else args.concurrency); returns the process and its URL once /health answers."""
    port = free_port()
    cmd = [sys.executable, "-m", "outrider.cli", "serve", "--port", str(port), "--threads", str(args.threads),
           "--max-running", str(max_running or args.max_running or args.concurrency), "--max-model-len", "1024",
           "--device", "cpu", *extra]
    if args.max_kv_rows:
        cmd += ["--max-kv-rows", str(args.max_kv_rows)]
    if args.model:
        cmd += ["--model", args.model]
    if args.drafter:
        cmd += ["--drafter", args.drafter]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while True:
        if proc.poll() is not None:
            sys.exit(f"outrider serve {' '.join(extra)} exited with {proc.returncode}: see {log}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            proc.kill()
            sys.exit(f"outrider serve {' '.join(extra)} did not start: see {log}")
        time.sleep(0.5)


def stop(proc: subprocess.Popen) -> int:
    """SIGTERM (the server stops its local Ray), SIGKILL after 120 s; the exit status."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def measure(name: str, extra: list[str], args, prompts, chat: bool) -> dict:
    proc, url = start(extra, args, args.out.with_suffix(f".{name}.log"))
    try:
        body = {"ignore_eos": True}
        mix = dict(lengths=tuple(args.lengths), sessions=args.sessions)
        warm = MixTarget(url, prompts, chat, args.max_tokens, extra=body, **mix)
        asyncio.run(closed_loop(warm, args.concurrency, args.concurrency, 0.0, args.concurrency))
        target = MixTarget(url, prompts, chat, args.max_tokens, extra=body, offset=args.concurrency, **mix)
        load = os.getloadavg()[0]
        if args.rate:  # open loop: Poisson arrivals, whatever the server's state
            records, wall = asyncio.run(open_loop(target, args.rate, 10 ** 6, args.phase_time))
        else:
            records, wall = asyncio.run(closed_loop(target, args.concurrency, 10 ** 6, args.phase_time, 1))
        summary = summarize(records, wall)
    finally:
        status = stop(proc)
    summary.update(setup=name, command=" ".join(extra) or "(one engine)", exit_status=status,
                   load_average_before=load)
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--drafter", default=None, help="as for outrider serve (default: none, autoregressive)")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--policy", default="least-load")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per engine")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-running", type=int, default=None, help="slots per replica (default: --concurrency)")
    parser.add_argument("--max-kv-rows", type=int, default=None, help="as for outrider serve (default: its own)")
    parser.add_argument("--lengths", type=lambda v: [int(x) for x in v.split(",")], default=[],
                        help="max_tokens by prompt index, e.g. 16,16,16,128 (default: --max-tokens for all)")
    parser.add_argument("--rate", type=float, default=0.0, help="open loop, requests/s (0: closed loop)")
    parser.add_argument("--sessions", type=int, default=0, help="repeating sessions (0: none)")
    parser.add_argument("--phase-time", type=float, default=40.0)
    parser.add_argument("--setups", default="single,one,many", help="single: no Ray; one: --replicas 1; many: N")
    parser.add_argument("--out", type=Path, default=Path("cluster-bench.json"))
    args = parser.parse_args()
    prompts, chat, _ = load_prompts(LoadPlan(model=args.model))
    setups = {"single": [], "one": ["--replicas", "1", "--policy", args.policy],
              "many": ["--replicas", str(args.replicas), "--policy", args.policy]}
    results = []
    for name in args.setups.split(","):
        r = measure(name, setups[name], args, prompts, chat)
        results.append(r)
        print(f"{name:>6} {r['command']:<32} {r['throughput_tok_s']:7.1f} tok/s  {r['requests_per_s']:.2f} req/s  "
              f"TTFT p50 {r['ttft_s']['p50']:.2f} s  e2e mean {r['e2e_s']['mean']:.2f} s  "
              f"p50 {r['e2e_s']['p50']:.2f} s  p99 {r['e2e_s']['p99']:.2f} s  "
              f"ok {r['ok']} errors {r['errors']} lost {r['lost']}  load {r['load_average_before']:.1f}", flush=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results},
                                   indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
