"""Cache-aware routing on real replicas: multi-turn chats against `outrider serve --replicas N`,
one policy after another (issue 42, item 4).

For each `--policy` the script starts `outrider serve --replicas N --policy P` (a local Ray,
each replica's engine with its own prefix cache: `--config gemm_prefill=off` on an Intel CPU,
where the float-GEMM prefill keeps the cache off), then runs `--clients` conversations of
`--turns` turns each, closed loop (a conversation sends its next turn when its answer has
ended): turn 1 a code-edit workload prompt, each later turn the history so far plus a follow-up
(the chat load of scripts/bench_prefix_cache.py), streamed, greedy. Per policy: the median time
to first token from turn 2 on, the share of those turns' prompt tokens the replicas had cached
(`usage.prompt_tokens_details.cached_tokens`), output tokens/s over the policy's wall time; the
greedy answers must be equal across policies (else the run fails). Under least-load a
conversation's turns land on either replica, and a turn on the one that did not serve the
previous turn prefills the history whole; under `prefix` (and WAR at high load) they follow
the replica holding the history.

    .venv/bin/python scripts/bench_prefix_routing.py --replicas 2 --clients 4 --turns 4 --max-tokens 32 \\
        --threads 1 --policy least-load --policy prefix --config gemm_prefill=off
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

from outrider.bench.serve_run import LoadPlan, ServerProcess
from outrider.bench.workloads import load_workload

HERE = Path(__file__).resolve().parent


def follow_ups() -> list[str]:
    spec = importlib.util.spec_from_file_location("bench_prefix_cache", HERE / "bench_prefix_cache.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.FOLLOW_UPS


async def turn(client: httpx.AsyncClient, url: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed chat completion: its text, TTFT, usage."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    sent, first, text, usage = time.perf_counter(), None, "", None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise SystemExit(f"the server answered {r.status_code}: {(await r.aread()).decode()[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            payload = json.loads(line[6:])
            for choice in payload.get("choices") or ():
                piece = (choice.get("delta") or {}).get("content") or ""
                if piece and first is None:
                    first = time.perf_counter()
                text += piece
            usage = payload.get("usage") or usage
    return {"text": text, "ttft": (first or time.perf_counter()) - sent, "usage": usage}


async def conversations(url: str, openings: list[list[dict]], turns: int, max_tokens: int, more: list[str]) -> list:
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0)) as client:
        async def one(messages: list[dict]) -> list[dict]:
            history, done = list(messages), []
            for t in range(turns):
                result = await turn(client, url, history, max_tokens)
                done.append(result)
                history += [{"role": "assistant", "content": result["text"]},
                            {"role": "user", "content": more[t % len(more)]}]
            return done

        return await asyncio.gather(*(one(m) for m in openings))


def run_policy(policy: str, args, openings, more, out: Path) -> dict:
    extra = ("--replicas", str(args.replicas), "--policy", policy, "--max-running", str(args.max_running),
             *(a for c in args.config for a in ("--config", c)))
    plan = LoadPlan(model=args.model, drafter=args.drafter, controller=args.controller, concurrency=(args.clients,),
                    threads=args.threads, server_args=extra)
    server = ServerProcess(plan, out / f"server-{policy.replace(':', '_')}.log", start_timeout=600)
    try:
        started = time.perf_counter()
        convs = asyncio.run(conversations(server.url, openings, args.turns, args.max_tokens, more))
        wall = time.perf_counter() - started
    finally:
        server.stop()
    later = [t for conv in convs for t in conv[1:]]
    prompt = sum(t["usage"]["prompt_tokens"] for t in later)
    cached = sum((t["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) for t in later)
    tokens = sum(t["usage"]["completion_tokens"] for conv in convs for t in conv)
    return {"policy": policy, "wall_s": wall, "output_tokens": tokens, "tokens_per_s": tokens / wall,
            "ttft_turn1_s": statistics.median(conv[0]["ttft"] for conv in convs),
            "ttft_later_s": statistics.median(t["ttft"] for t in later) if later else None,
            "cached_share_later": cached / prompt if prompt else None,
            "answers": [[t["text"] for t in conv] for conv in convs]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--policy", action="append", default=[], help="repeatable (default: least-load, prefix)")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-running", type=int, default=4, help="each replica's slots")
    ap.add_argument("--drafter", default="suffix")
    ap.add_argument("--controller", default="cost")
    ap.add_argument("--threads", type=int, default=1, help="each replica's CPU threads")
    ap.add_argument("--config", action="append", default=[], metavar="KEY=VALUE", help="the server's --config")
    ap.add_argument("--out", default="prefix-routing-results")
    args = ap.parse_args()
    policies = args.policy or ["least-load", "prefix"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    openings = [list(p.messages) for p in load_workload("code-edit", limit=args.clients).prompts]
    more = follow_ups()
    results = [run_policy(p, args, openings, more, out) for p in policies]
    same = all(r["answers"] == results[0]["answers"] for r in results)
    (out / "results.json").write_text(json.dumps({"args": vars(args), "results": results, "answers_equal": same},
                                                 indent=1))
    print(f"{args.replicas} replicas x {args.max_running} slots, {args.threads} thread(s) each; {args.clients} "
          f"conversations x {args.turns} turns, {args.max_tokens} tokens a turn; greedy answers equal across "
          f"policies: {'yes' if same else 'NO'}")
    print("| policy | TTFT turn 1 | TTFT turns 2+ (median) | cached share of turns 2+ prompts | output tok/s | wall |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['policy']} | {r['ttft_turn1_s']:.2f} s | {r['ttft_later_s']:.2f} s | "
              f"{r['cached_share_later']:.0%} | {r['tokens_per_s']:.1f} | {r['wall_s']:.0f} s |")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
