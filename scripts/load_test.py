"""Serving load benchmark: `outrider serve` under closed-loop clients and open-loop arrivals.

Starts `outrider serve` itself (a subprocess on a free 127.0.0.1 port; nothing leaves this
machine), sends streaming completions of HumanEval prompts (the bench's packaged workload,
fetched once and cached), closed-loop at each --concurrency and open-loop (Poisson arrivals)
at each --rates, every phase with speculation off (`speculate: false` per request) and on
(the server's --drafter/--controller), alternating so that both see the same machine load.
Each phase stops sending after --requests requests or --phase-time seconds. Reports output
tokens/s, TTFT and TPOT p50/p99, errors and lost requests, checks /metrics against the
client's counts, and judges the goals of issue 8 (item 7). Writes into --out:

    results.json   the plan, every phase (summary, metrics check, every request), the goals
    load.png       throughput, TTFT and TPOT against concurrency; open-loop against rate
    server.log     the server's own output

    .venv/bin/python scripts/load_test.py --quick       # 5.5 min on 2 cores at load 4-5 (SmolLM2)
    .venv/bin/python scripts/load_test.py --soak 300 --out load-full
    .venv/bin/python scripts/load_test.py --quick --against llama-server:ngram-mod --concurrency 1,4,16 \
        --threads 1 --workload code-edit      # against llama.cpp's server (outrider/bench/serve_peer.py)

A script rather than `outrider bench serve`: `outrider bench` is the offline method comparison
with its own flags, and the load test needs none of its machinery (the logic is in
outrider/bench/serve_load.py and serve_run.py, importable).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from matplotlib.figure import Figure

from outrider.bench.serve_run import MODES, LoadPlan, run_load
from outrider.errors import OutriderError

PRESETS = {
    # 5.5 minutes with SmolLM2-135M on 2 cores already busy (load average 4-5)
    "quick": dict(max_tokens=32, requests=32, phase_s=8.0, min_requests=3, rates=(0.5, 1.0), soak_s=0.0),
    "full": dict(max_tokens=128, requests=256, phase_s=60.0, min_requests=8, rates=(0.5, 1.0, 2.0, 4.0), soak_s=300.0),
}


def parse_args(argv=None, with_against: bool = False) -> tuple:
    """(plan, out), and --against's value too when `with_against`."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the quick preset (default: full)")
    ap.add_argument("--model", default=None, help="catalog name or model folder (default: smollm2-135m-instruct)")
    ap.add_argument("--drafter", default="suffix", help="the server's drafter for the 'on' phases (default suffix)")
    ap.add_argument("--controller", default="cost", help="the server's controller (default cost: backs off as the batch grows)")
    ap.add_argument("--tree", default="chain")
    ap.add_argument("--workload", default="humaneval", help="humaneval | toolcall | code-edit | jsonl:PATH")
    ap.add_argument("--prompts", type=int, default=None, help="use the workload's first N prompts (default: all)")
    ap.add_argument("--max-tokens", type=int, default=None, help="max_tokens of every request")
    ap.add_argument("--concurrency", default="1,4,16,32", help="closed-loop clients, comma-separated")
    ap.add_argument("--rates", default=None, help="open-loop arrivals per second, comma-separated ('' for none)")
    ap.add_argument("--requests", type=int, default=None, help="at most this many requests per phase")
    ap.add_argument("--phase-time", type=float, default=None, help="no request sent after this many seconds ...")
    ap.add_argument("--min-requests", type=int, default=None, help="... once a closed-loop phase has sent this many")
    ap.add_argument("--soak", type=float, default=None,
                    help="then the largest concurrency, the last of --modes, for this many seconds (0: none)")
    ap.add_argument("--modes", default="off,on", help="speculation off and/or on")
    ap.add_argument("--threads", type=int, default=None, help="the server's CPU threads")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--request-timeout", type=float, default=300.0, help="a request unanswered this long is lost")
    ap.add_argument("--out", default=None, help="output folder (default load-results/<time>)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="off/on pairs per closed-loop level, every other one on first (figures pooled)")
    ap.add_argument("--prefix-cache", action="store_true",
                    help="keep the server's prefix cache on (default: off, for a fair comparison: the off and on "
                         "phases send the same prompts, so a later phase would reuse an earlier one's prefill)")
    ap.add_argument("--no-prefix-cache", action="store_true", help="the server's prefix cache off (the default)")
    ap.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                    help="the server's --config (e.g. gemm_prefill=off, where the prefix cache needs it)")
    ap.add_argument("--against", default=None, metavar="llama-server[:TYPE]",
                    help="instead: the same closed-loop levels on outrider serve (speculation on) and on "
                         "llama-server (e.g. llama-server:ngram-mod), one after the other (bench/serve_peer.py)")
    args = ap.parse_args(argv)
    preset = PRESETS["quick" if args.quick else "full"]
    chosen = {"prompts": args.prompts, "max_tokens": args.max_tokens, "requests": args.requests,
              "phase_s": args.phase_time, "soak_s": args.soak, "min_requests": args.min_requests,
              "rates": None if args.rates is None else _numbers(args.rates, float, "--rates")}
    settings = {**preset, **{k: v for k, v in chosen.items() if v is not None}}
    plan = LoadPlan(model=args.model, drafter=args.drafter, controller=args.controller, tree=args.tree,
                    workload=args.workload, concurrency=_numbers(args.concurrency, int, "--concurrency"),
                    modes=tuple(m.strip() for m in args.modes.split(",") if m.strip()), threads=args.threads,
                    device=args.device, request_timeout=args.request_timeout,
                    server_args=(() if args.prefix_cache and not args.no_prefix_cache else ("--no-prefix-cache",))
                    + tuple(a for c in args.config for a in ("--config", c)), repeats=args.repeats, **settings)
    out = Path(args.out or Path("load-results") / time.strftime("%Y%m%d-%H%M%S"))
    return (plan.check(), out, args.against) if with_against else (plan.check(), out)


def _numbers(text: str, kind, flag: str) -> tuple:
    from outrider.errors import ConfigError

    try:
        return tuple(kind(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"{flag} takes comma-separated numbers, got '{text}'") from None


# ---- table and plot ---------------------------------------------------------------------------

def table(results: dict) -> str:
    """The phases as a markdown table (as in docs/benchmarks/2026-11-30-intel-xeon-avx512-amx.md, Serving)."""
    rows = ["| phase | spec | ok / sent | errors | lost | output tok/s | TTFT p50 / p99 (s) "
            "| TPOT p50 / p99 (ms) | tau |", "|---|---|---|---|---|---|---|---|---|"]
    for p in results["phases"]:
        what = (f"open, {p['rate']:g} req/s" if p["kind"] == "open" else
                f"soak, {p['concurrency']} clients, {p['time_limit_s']:g} s" if p["kind"] == "soak" else
                f"closed, {p['concurrency']} clients")
        ttft, tpot = p["ttft_s"], p["tpot_s"]
        rows.append(f"| {what} | {p['mode']} | {p['ok']} / {p['requests']} | {p['errors']} | {p['lost']} | "
                    f"{p['throughput_tok_s']:.1f} | {_f(ttft['p50'])} / {_f(ttft['p99'])} | "
                    f"{_f(tpot['p50'], 1000, 0)} / {_f(tpot['p99'], 1000, 0)} | {_f(p['tau'])} |")
    return "\n".join(rows)


def goals_text(results: dict) -> str:
    g = results["goals"]
    lines = []
    for key, label in (("scaling_c16_over_c1_spec_off", "throughput c=16 / c=1, spec off"),
                       ("scaling_c16_over_c1_spec_on", "throughput c=16 / c=1, spec on"),
                       ("spec_on_over_off_c1", "spec on / off at c=1"),
                       ("spec_on_over_off_c32", "spec on / off at c=32")):
        v = g[key]
        met = {True: "met", False: "NOT met", None: "not measured"}[v["met"]]
        value = "-" if v["value"] is None else f"{v['value']:.2f}x"
        lines.append(f"{label}: {value} (goal >= {v['goal']}x): {met}")
    for c, v in sorted(g.get("spec_on_over_off_by_concurrency", {}).items()):  # every level, wall and CPU
        cpu = g.get("spec_on_over_off_by_concurrency_cpu", {}).get(c)
        lines.append(f"spec on / off at c={c}: {_f(v)}x output tokens/s, {_f(cpu)}x per server CPU second")
    soak = g["soak"]
    if soak["met"] is not None:
        lines.append(f"soak, {soak['clients']} clients for {soak['seconds']:g} s: {soak['requests']} requests, "
                     f"{soak['errors']} errors, {soak['lost']} lost: {'met' if soak['met'] else 'NOT met'}")
    e = g["no_errors_no_lost"]
    lines.append(f"all phases: {e['errors']} errors, {e['lost']} lost; /metrics "
                 f"{'agree' if e['metrics_agree'] else 'DISAGREE'} with the client's counts")
    return "\n".join(lines)


def _f(x, scale=1.0, digits=2) -> str:
    return "-" if x is None else f"{x * scale:.{digits}f}"


def plot(results: dict, path: Path) -> Path:
    phases = results["phases"]
    fig = Figure(figsize=(11, 8))
    axes = fig.subplots(2, 2)
    colours = {"off": "#4C72B0", "on": "#DD8452"}
    for mode in MODES:
        closed = sorted((p for p in phases if p["kind"] == "closed" and p["mode"] == mode),
                        key=lambda p: p["concurrency"])
        if not closed:
            continue
        xs = [p["concurrency"] for p in closed]
        axes[0, 0].plot(xs, [p["throughput_tok_s"] for p in closed], "o-", color=colours[mode], label=f"spec {mode}")
        for ax, key, scale in ((axes[0, 1], "ttft_s", 1.0), (axes[1, 0], "tpot_s", 1000.0)):
            for q, style in (("p50", "o-"), ("p99", "s--")):
                ys = [None if p[key][q] is None else p[key][q] * scale for p in closed]
                ax.plot(xs, [float("nan") if y is None else y for y in ys], style, color=colours[mode],
                        label=f"spec {mode} {q}")
        opened = sorted((p for p in phases if p["kind"] == "open" and p["mode"] == mode), key=lambda p: p["rate"])
        if opened:
            rates = [p["rate"] for p in opened]
            axes[1, 1].plot(rates, [p["throughput_tok_s"] for p in opened], "o-", color=colours[mode],
                            label=f"spec {mode} tok/s")
            ttft = [p["ttft_s"]["p50"] for p in opened]
            axes[1, 1].plot(rates, [float("nan") if t is None else t for t in ttft], "s--", color=colours[mode],
                            label=f"spec {mode} TTFT p50 (s)")
    titles = (("closed loop: output tokens/s", "tokens/s"), ("closed loop: time to first token", "seconds"),
              ("closed loop: time per output token", "milliseconds"), ("open loop (Poisson arrivals)", ""))
    for ax, (title, ylabel) in zip(axes.flat, titles):
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    levels = sorted({p["concurrency"] for p in phases if p["kind"] == "closed"})
    for ax in (axes[0, 0], axes[0, 1], axes[1, 0]):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrent clients")
    axes[1, 1].set_xlabel("arrivals per second")
    load = results["load_average"]["before"][0]
    fig.suptitle(f"outrider serve under load: {results['plan']['model'] or 'smollm2-135m-instruct'}, "
                 f"{results['plan']['drafter']} {results['plan']['controller']}, {results['cpus']} CPUs, "
                 f"load average {load:.1f}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})
    return path


def _against(plan: LoadPlan, kind: str, out: Path, log) -> int:
    """--against: outrider serve and llama-server under the same load (bench/serve_peer.py)."""
    from outrider.bench.serve_peer import against_table, run_against

    results = run_against(plan, kind, out, log=log)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(against_table(results))
    la = results["load_average"]
    print(f"\n{results['cpus']} CPUs, load average {la['before'][0]:.2f} before, {la['after'][0]:.2f} after; "
          f"{results['wall_s']:.0f} s in all\nresults: {out / 'results.json'}")
    return 0


def main(argv=None) -> int:
    try:
        plan, out, against = parse_args(argv, with_against=True)
        if out.exists() and any(out.iterdir()):
            from outrider.errors import ConfigError

            raise ConfigError(f"--out {out} is not empty: give a new or empty folder")
        log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
        if against:
            return _against(plan, against, out, log)
        results = run_load(plan, out, log=log)
    except OutriderError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    (out / "results.json").write_text(json.dumps(results, indent=1))
    plot(results, out / "load.png")
    print(table(results))
    print()
    print(goals_text(results))
    la = results["load_average"]
    print(f"\n{results['cpus']} CPUs, load average {la['before'][0]:.2f} before, {la['after'][0]:.2f} after; "
          f"{results['wall_s']:.0f} s in all; server exit status {results['server_exit_status']}")
    print(f"results: {out / 'results.json'}\nplot:    {out / 'load.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
