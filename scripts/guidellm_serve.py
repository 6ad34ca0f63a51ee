"""Drive guidellm (an external load generator) against `outrider serve`, and record its
throughput, TTFT and ITL beside the built-in load test's (outrider/bench/serve_load.py) on the
same prompts and the same requests.

Starts `outrider serve` (a subprocess on a free 127.0.0.1 port; nothing leaves the machine),
writes the workload's prompts as a JSONL file guidellm reads (`prompt`, `output_tokens_count`:
guidellm then sends max_tokens, ignore_eos and stop: null, as it does against vLLM), and runs,
at each --concurrency, guidellm's concurrent profile and the built-in closed loop with the same
bodies (temperature 0, ignore_eos, the same max_tokens). guidellm is an optional extra that
`make test` never installs:

    .venv/bin/pip install -e '.[guidellm]'            # or point --guidellm at its executable
    .venv/bin/python scripts/guidellm_serve.py --concurrency 1,4 --requests 32 --max-tokens 64
    .venv/bin/python scripts/guidellm_serve.py --dry-run   # the scenario and command, no run

guidellm needs no network here: its tokenizer is the served model's own folder, its data a
local file. Level by level the two tools take turns, the first alternating. Writes into --out:
guidellm-<level>.json and .log (its report and output), scenario-<level>.json, prompts.jsonl,
server.log, results.json (both tools' figures side by side, also printed as a table).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

GUIDELLM = "guidellm"


def scenario(target: str, model: str, tokenizer: str, data: Path, concurrency: list[int], requests: int,
             seconds: float, chat: bool = False, api_key: str | None = None) -> dict:
    """guidellm's scenario file: one concurrent benchmark per level, `requests` requests each (or
    `seconds`), the prompts of `data`, greedy (temperature 0) like the built-in load test."""
    backend = {"kind": "openai_http", "target": target, "model": model,
               "request_format": "/v1/chat/completions" if chat else "/v1/completions",
               "extras": {"body": {"temperature": 0}}, "timeout": 600}
    if api_key:
        backend["api_key"] = api_key
    return {
        "metadata": {"name": "outrider-serve", "description": "outrider serve under guidellm's concurrent profile"},
        "spec": {
            "backend": backend,
            "profile": {"kind": "concurrent", "streams": concurrency[0]},
            "data": [{"kind": "json_file", "path": str(data)}],
            "tokenizer": {"kind": "huggingface_auto", "model": tokenizer},
            "constraints": [{"kind": "max_requests", "count": requests},
                            {"kind": "max_duration", "seconds": seconds}],
        },
        "benchmarks": [{"profile.streams": c} for c in concurrency],
    }


def command(exe: str, scenario_path: Path, report: Path) -> list[str]:
    return [exe, "run", "--scenario", str(scenario_path), "--output", f"kind=json,path={report}",
            "--disable-console-interactive"]


def prompts_jsonl(prompts: list, max_tokens: int) -> str:
    """One JSON line per prompt: guidellm's `prompt` and `output_tokens_count` columns."""
    return "".join(json.dumps({"prompt": p, "output_tokens_count": max_tokens}) + "\n" for p in prompts)


def _find(obj, *keys):
    for key in keys:
        if not isinstance(obj, dict) or key not in obj:
            return None
        obj = obj[key]
    return obj


def _stat(metrics: dict, name: str, scale: float = 1.0) -> dict:
    """p50, p99 and mean of one of guidellm's metric distributions (successful requests), scaled."""
    dist = _find(metrics, name, "successful") or _find(metrics, name, "total") or {}
    pct = dist.get("percentiles") or {}

    def pick(*names):
        for n in names:
            if pct.get(n) is not None:
                return pct[n] * scale
            if dist.get(n) is not None:
                return dist[n] * scale
        return None

    return {"p50": pick("p50", "median"), "p99": pick("p99"), "mean": pick("mean")}


def parse_report(report: dict) -> list[dict]:
    """Per benchmark of a guidellm JSON report: the concurrency, requests by status, output
    tokens/s, TTFT and ITL in seconds (guidellm reports milliseconds)."""
    out = []
    for bench in report.get("benchmarks", []):
        metrics = bench.get("metrics", {})
        totals = _find(metrics, "request_totals") or {}
        tokens = _find(metrics, "output_token_count", "successful", "total_sum")
        duration = bench.get("duration")
        out.append({
            "concurrency": _find(bench, "config", "strategy", "streams"),
            "requests": {k: totals.get(k) for k in ("successful", "errored", "incomplete") if k in totals},
            # output tokens of the successful requests over the benchmark's time, as the built-in
            # load test counts (guidellm's own "output tokens per second" is a mean over samples)
            "throughput_tok_s": tokens / duration if tokens is not None and duration else None,
            "guidellm_output_tok_s_mean": _stat(metrics, "output_tokens_per_second")["mean"],
            "ttft_s": _stat(metrics, "time_to_first_token_ms", 1e-3),
            "itl_s": _stat(metrics, "inter_token_latency_ms", 1e-3),
            "e2e_s": _stat(metrics, "request_latency"),
        })
    return out


def builtin(url: str, prompts: list, chat: bool, max_tokens: int, concurrency: int, requests: int,
            seconds: float) -> dict:
    """The built-in closed loop with the bodies guidellm sends (ignore_eos, stop null, greedy)."""
    from outrider.bench.serve_load import Target, closed_loop, summarize

    target = Target(url, prompts, chat, max_tokens, extra={"ignore_eos": True, "stop": None})
    records, wall = asyncio.run(closed_loop(target, concurrency, requests, seconds, min_requests=requests))
    s = summarize(records, wall)
    return {"concurrency": concurrency, "requests": {"successful": s["ok"], "errored": s["errors"] + s["lost"]},
            "throughput_tok_s": s["throughput_tok_s"], "ttft_s": s["ttft_s"], "itl_s": s["tpot_s"],
            "e2e_s": s["e2e_s"], "tau": s["tau"]}


def _fmt(x, scale=1.0) -> str:
    return "-" if x is None else f"{x * scale:.2f}"


def table(rows: list[tuple[str, dict]]) -> str:
    lines = ["tool      conc  ok  tok/s   TTFT p50/p99 ms   ITL p50/p99 ms",
             "--------  ----  --  ------  ----------------  --------------"]
    for tool, r in rows:
        ok = (r.get("requests") or {}).get("successful")
        lines.append(f"{tool:<8}  {r.get('concurrency') or '-':>4}  {ok if ok is not None else '-':>2}  "
                     f"{_fmt(r['throughput_tok_s']):>6}  "
                     f"{_fmt(r['ttft_s']['p50'], 1e3):>7}/{_fmt(r['ttft_s']['p99'], 1e3):<8}  "
                     f"{_fmt(r['itl_s']['p50'], 1e3):>6}/{_fmt(r['itl_s']['p99'], 1e3)}")
    return "\n".join(lines)


def find_guidellm(given: str | None) -> str | None:
    if given:
        return given if Path(given).exists() or shutil.which(given) else None
    beside = Path(sys.executable).with_name(GUIDELLM)
    return str(beside) if beside.exists() else shutil.which(GUIDELLM)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="catalog name or model folder")
    ap.add_argument("--drafter", default="suffix")
    ap.add_argument("--controller", default="cost")
    ap.add_argument("--workload", default="humaneval", help="the built-in load test's workloads")
    ap.add_argument("--prompts", type=int, default=32, help="the workload's first N prompts")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", default="1,4", help="comma-separated")
    ap.add_argument("--requests", type=int, default=32, help="requests per level and tool")
    ap.add_argument("--seconds", type=float, default=300, help="at most this long per level and tool")
    ap.add_argument("--threads", type=int, default=None, help="the server's CPU threads")
    ap.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                    help="one more `outrider serve` argument, repeatable (e.g. --server-arg=--no-prefix-cache)")
    ap.add_argument("--guidellm", default=None, help="guidellm's executable (default: beside python, or on PATH)")
    ap.add_argument("--skip-builtin", action="store_true", help="guidellm alone")
    ap.add_argument("--dry-run", action="store_true", help="write the scenario, print the command, run nothing")
    ap.add_argument("--out", default=None, help="output folder (default guidellm-results/<time>)")
    args = ap.parse_args(argv)

    from outrider.bench.serve_run import LoadPlan, ServerProcess, load_prompts
    from outrider.catalog.resolve import resolve_model
    from outrider.errors import OutriderError

    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    out = Path(args.out or Path("guidellm-results") / time.strftime("%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    plan = LoadPlan(model=args.model, drafter=args.drafter, controller=args.controller, workload=args.workload,
                    prompts=args.prompts, max_tokens=args.max_tokens, concurrency=tuple(levels),
                    requests=max(args.requests, 256), threads=args.threads,
                    server_args=tuple(args.server_arg)).check()
    try:
        prompts, chat, source = load_prompts(plan)
        folder = resolve_model(args.model)
    except OutriderError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if chat and not args.dry_run:  # guidellm 0.8 drops every row whose prompt is a message list, then waits
        print(f"error: guidellm reads text prompts, and --workload {args.workload} is chat messages: use a "
              "completion workload (humaneval, or a jsonl of 'prompt' lines)", file=sys.stderr)
        return 2
    data = out / "prompts.jsonl"
    data.write_text(prompts_jsonl(prompts, args.max_tokens))
    exe = find_guidellm(args.guidellm)
    if exe is None and not args.dry_run:
        print("error: guidellm is not installed: .venv/bin/pip install -e '.[guidellm]' (or pass --guidellm PATH)",
              file=sys.stderr)
        return 2
    name = folder.name if Path(args.model).exists() else args.model  # the id the server serves
    if args.dry_run:
        spec_path, report = out / "scenario.json", out / "guidellm.json"
        spec_path.write_text(json.dumps(scenario("http://127.0.0.1:PORT", name, str(folder), data, levels,
                                                 args.requests, args.seconds, chat), indent=1))
        print(" ".join(command(exe or GUIDELLM, spec_path, report)))
        return 0
    server = ServerProcess(plan, out / "server.log")
    rows, results = [], {"model": name, "workload": source, "prompts": len(prompts), "max_tokens": args.max_tokens,
                         "server_command": server.command}
    results["guidellm"] = {"runs": [], "benchmarks": [], "exit_status": 0}
    results["builtin"] = []
    try:
        # level by level, the two tools in turn and the first of them alternating: a drafter that
        # learns across requests (suffix) and the machine's load favour neither
        for i, level in enumerate(levels):
            tools = ["guidellm"] + ([] if args.skip_builtin else ["builtin"])
            for tool in tools if i % 2 == 0 else tools[::-1]:
                if tool == "builtin":
                    row = builtin(server.url, prompts, chat, args.max_tokens, level, args.requests, args.seconds)
                    results["builtin"].append(row)
                    rows.append(("builtin", row))
                    continue
                spec_path = out / f"scenario-{level}.json"
                report = out / f"guidellm-{level}.json"
                spec_path.write_text(json.dumps(scenario(server.url, name, str(folder), data, [level], args.requests,
                                                         args.seconds, chat), indent=1))
                cmd = command(exe, spec_path, report)
                print(" ".join(cmd), file=sys.stderr)
                started = time.time()
                proc = subprocess.run(cmd, capture_output=True, text=True)
                (out / f"guidellm-{level}.log").write_text(proc.stdout + proc.stderr)
                results["guidellm"]["runs"].append({"command": cmd, "exit_status": proc.returncode,
                                                    "wall_s": time.time() - started})
                if proc.returncode != 0 or not report.exists():
                    results["guidellm"]["exit_status"] = proc.returncode or 1
                    print(f"guidellm failed (status {proc.returncode}); its output is in "
                          f"{out / f'guidellm-{level}.log'}:\n" + (proc.stdout + proc.stderr)[-3000:], file=sys.stderr)
                    continue
                for row in parse_report(json.loads(report.read_text())):
                    results["guidellm"]["benchmarks"].append(row)
                    rows.append(("guidellm", row))
    finally:
        results["server_exit_status"] = server.stop()
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print(table(rows))
    print(f"written to {out}", file=sys.stderr)
    return 0 if results["guidellm"]["exit_status"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
