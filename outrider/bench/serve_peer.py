"""Serving against llama.cpp's llama-server (issue 45, item 2): the same closed-loop load on both.

    results = run_against(plan, "llama-server:ngram-mod", out)     # scripts/load_test.py --against

Two servers on loopback ports, both with speculation on and greedy, both on the model's packaged
GGUF (catalog models keep `original.gguf`; ours runs its own blocks of it):

    outrider serve   the plan's drafter and controller (suffix, cost by default), --max-running
                     the largest concurrency, --threads the plan's (1 when not given)
    llama-server     `--spec-type TYPE` of the kind (llama-server[:TYPE]; draft-simple needs a draft
                     model and is not run here), -np the largest concurrency, -c that many times
                     PER_SLOT rows, -t / -tb the same threads; its defaults otherwise (its prompt
                     cache on), started as the bench's peer starts it (bench/llama_server.py: with
                     --no-repack where its defaults crash)

At each concurrency both servers get the same requests (the workload's next prompts, the same
max_tokens, temperature 0, streamed: serve_load.py measures TTFT, TPOT and throughput alike),
one server after the other, the order alternating level by level so neither always runs second
on this shared machine. A warm-up request on each first. The idle server waits on its socket.
`ratio` is ours over theirs, per level: throughput (higher is ours better) and TTFT / TPOT p50
(lower is ours better). The goal of issue 45: our throughput >= 1.5x llama-server's at 1, 4 and
16 clients.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import asdict
from pathlib import Path

from ..errors import ConfigError
from .llama_server import NEEDS_DRAFT, LlamaServerPeer, find_binary, parse_kind
from .peer_process import PeerFailed, PeerUnavailable
from .serve_load import Target, closed_loop, records_json, summarize
from .serve_run import LoadPlan, ServerProcess, load_prompts

PER_SLOT = 4096  # llama-server's K/V rows a slot: the longest prompt of the loads plus its answer
GOAL = 1.5  # our throughput over llama-server's, at every concurrency
OURS, THEIRS = "outrider", "llama-server"


def model_folder(plan: LoadPlan) -> Path:
    from ..catalog.packages import DEFAULT_MODEL
    from ..catalog.resolve import resolve_model

    return resolve_model(plan.model or DEFAULT_MODEL)


def start_llama_server(kind: str, folder: Path, threads: int, slots: int) -> LlamaServerPeer:
    """llama-server for `kind` on the folder's original GGUF with `slots` slots; ConfigError where
    it cannot run (no binary, no GGUF, a kind that needs a draft, a crash while it starts)."""
    spec, _ = parse_kind(kind)
    if spec in NEEDS_DRAFT:
        raise ConfigError(f"--against {kind}: draft-simple needs a draft model; the load test runs "
                          "llama-server plain or with an n-gram spec type (ngram-mod, ngram-cache, ...)")
    gguf = folder / "original.gguf"
    if not gguf.is_file():
        raise ConfigError(f"--against {kind}: no original GGUF at {gguf} (only catalog models keep one)")
    try:
        return LlamaServerPeer(find_binary(), gguf, kind, threads, slots=slots, context=slots * PER_SLOT)
    except (PeerUnavailable, PeerFailed) as why:
        raise ConfigError(f"--against {kind}: {why}") from None


def _phase(name: str, target: Target, concurrency: int, plan: LoadPlan, log) -> dict:
    least = min(plan.min_requests, plan.requests)
    load = os.getloadavg()[0]
    records, wall = asyncio.run(closed_loop(target, concurrency, plan.requests, plan.phase_s, least))
    summary = summarize(records, wall)
    log(f"  c={concurrency:<3} {name:12}: {summary['ok']}/{summary['requests']} ok, {summary['throughput_tok_s']:.1f} "
        f"tok/s, TTFT p50 {_fmt(summary['ttft_s']['p50'])} s, TPOT p50 {_fmt(summary['tpot_s']['p50'], 1000)} ms, "
        f"acceptance {summary['acceptance']:.2f}, load average {load:.1f}")
    return {"server": name, "concurrency": concurrency, "load_average": load, **summary,
            "records": records_json(records)}


def _fmt(x, scale=1.0) -> str:
    return "-" if x is None else f"{x * scale:.2f}"


def run_against(plan: LoadPlan, kind: str, out: Path, log=print) -> dict:
    """Closed-loop phases at each of the plan's concurrencies on outrider serve and llama-server
    (module docstring); a results.json-ready dict."""
    plan.check()
    prompts, chat, source = load_prompts(plan)
    folder = model_folder(plan)
    threads = plan.threads or 1
    plan = LoadPlan(**{**asdict(plan), "threads": threads, "modes": ("on",)})
    out.mkdir(parents=True, exist_ok=True)
    started, load_before = time.time(), os.getloadavg()
    theirs = start_llama_server(kind, folder, threads, max(plan.concurrency))
    ours = None
    phases = []
    try:
        ours = ServerProcess(plan, out / "server.log")
        log(f"outrider serve on {ours.url}; {' '.join(theirs.args[1:])}; load average {load_before[0]:.2f}")
        targets = {OURS: Target(ours.url, prompts, chat, plan.max_tokens, request_timeout=plan.request_timeout),
                   THEIRS: Target(theirs.url, prompts, chat, plan.max_tokens, request_timeout=plan.request_timeout)}
        offset = 0
        for name, target in targets.items():  # warm-up: first-call costs, the cost controller's profile
            asyncio.run(closed_loop(target, 1, 1, plan.phase_s, 1))
        offset += 1
        for i, c in enumerate(plan.concurrency):
            order = [OURS, THEIRS] if i % 2 == 0 else [THEIRS, OURS]
            done = []
            for name in order:
                targets[name].offset = offset
                done.append(_phase(name, targets[name], c, plan, log))
            phases += done
            offset += max(p["requests"] for p in done)
    finally:
        our_status = ours.stop() if ours is not None else None
        theirs.close()
    return {"plan": asdict(plan), "against": kind, "server_command": ours.command if ours else None,
            "llama_server_command": theirs.args, "llama_server_note": theirs.note, "workload_source": source,
            "server_exit_status": our_status, "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
            "wall_s": time.time() - started, "cpus": os.cpu_count(),
            "load_average": {"before": list(load_before), "after": list(os.getloadavg())},
            "phases": phases, "ratios": ratios(phases)}


def _ratio(a, b):
    return None if a is None or not b else a / b


def ratios(phases: list[dict]) -> dict:
    """Per concurrency: ours over theirs (throughput, TTFT p50, TPOT p50) and the goal's verdict."""
    out = {}
    for c in sorted({p["concurrency"] for p in phases}):
        by = {p["server"]: p for p in phases if p["concurrency"] == c}
        if OURS not in by or THEIRS not in by:
            continue
        a, b = by[OURS], by[THEIRS]
        throughput = _ratio(a["throughput_tok_s"], b["throughput_tok_s"]) if a["ok"] and b["ok"] else None
        out[c] = {"throughput": throughput, "ttft_p50": _ratio(a["ttft_s"]["p50"], b["ttft_s"]["p50"]),
                  "tpot_p50": _ratio(a["tpot_s"]["p50"], b["tpot_s"]["p50"]), "goal": GOAL,
                  "met": None if throughput is None else throughput >= GOAL}
    return out


def against_table(results: dict) -> str:
    """The phases side by side, a markdown table, and the goal per concurrency."""
    rows = ["| clients | server | ok / sent | output tok/s | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) "
            "| drafts accepted | ours / theirs tok/s |", "|---|---|---|---|---|---|---|---|"]
    for p in results["phases"]:
        r = results["ratios"].get(p["concurrency"]) or {}
        ratio = f"{r['throughput']:.2f}x" if p["server"] == OURS and r.get("throughput") is not None else ""
        ttft, tpot = p["ttft_s"], p["tpot_s"]
        rows.append(f"| {p['concurrency']} | {p['server']} | {p['ok']} / {p['requests']} | "
                    f"{p['throughput_tok_s']:.1f} | {_fmt(ttft['p50'])} / {_fmt(ttft['p99'])} | "
                    f"{_fmt(tpot['p50'], 1000)} / {_fmt(tpot['p99'], 1000)} | "
                    f"{p['acceptance']:.2f} | {ratio} |")
    lines = ["\n".join(rows), ""]
    for c, r in results["ratios"].items():
        met = {True: "met", False: "NOT met", None: "not measured"}[r["met"]]
        value = "-" if r["throughput"] is None else f"{r['throughput']:.3f}x"
        lines.append(f"throughput ours / llama-server at {c} clients: {value} (goal >= {r['goal']}x): {met}")
    return "\n".join(lines)
