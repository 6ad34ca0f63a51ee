"""Decode speed on a shared CPU: alone, then beside a busy-loop neighbour, per thread setting.

Decodes N tokens of the packaged SmolLM2 through `outrider.LLM(...).generate` (greedy, one fixed
prompt that runs past 96 tokens without EOS) twice in one process: once alone and once while a
neighbour process spins one busy thread in pure Python. Each configuration runs in a FRESH
subprocess, because OpenMP reads its settings (OMP_WAIT_POLICY, GOMP_SPINCOUNT) once, when torch
loads libgomp. The runs are interleaved (configurations A, B, C, A, B, C, ...), the alone and
neighbour phases swap order every repeat, and the table shows medians.

    .venv/bin/python scripts/bench_shared_cpu.py                     # the default configurations
    .venv/bin/python scripts/bench_shared_cpu.py --repeats 5 --max-busy 0.3 \\
        "t2-fixed:threads=2" "t2-passive:threads=2,OMP_WAIT_POLICY=PASSIVE" "outrider:"
    .venv/bin/python scripts/bench_shared_cpu.py --alone-only ...    # quiet speed only

A configuration is NAME:KEY=VALUE,KEY=VALUE. `threads=N` passes LLM(threads=N), a fixed count;
without it outrider chooses (outrider/engine/threads.py: one thread per core other processes leave
free). Upper-case keys are environment variables of the subprocess; OMP_WAIT_POLICY,
GOMP_SPINCOUNT, KMP_BLOCKTIME and OMP_NUM_THREADS are removed from it unless the configuration
sets them, so the shell's settings do not leak in.

Columns: decode tokens/s (prefill excluded) alone and with the neighbour, their ratio (each
run's in brackets), the ratio a fair share would give (the neighbour owns one core and we keep
the rest: (cores - 1) / threads, at most 1), our CPU time per token, the cores the neighbour got,
the mean thread count while the neighbour ran, and the cores other work kept busy just before
each run (measured from /proc/stat; --max-busy waits for a quieter moment). The machine is
shared: absolute figures move with its load, the ratios much less.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PROMPT = "def quicksort(arr):\n    \"\"\"Sort a list of numbers with quicksort.\"\"\"\n"
# one busy thread in pure Python, which stops by itself if our subprocess dies
NEIGHBOUR = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    for _ in range(100000):\n        pass\n"
THREAD_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME", "OMP_NUM_THREADS")

DEFAULT_CONFIGS = [
    "t2-fixed:threads=2",  # what outrider did before it chose: 2 threads, libgomp's spinning waits
    "t1-fixed:threads=1",
    "outrider:",  # the default now: one thread per free core (outrider/engine/threads.py)
    "t2-passive:threads=2,OMP_WAIT_POLICY=PASSIVE",
    "t2-active:threads=2,OMP_WAIT_POLICY=ACTIVE",
    "t2-spin30k:threads=2,GOMP_SPINCOUNT=30000",
]


def parse_config(text: str) -> dict:
    """NAME:KEY=VALUE,... -> {"name", "threads" (None: outrider chooses), "env"}."""
    name, _, body = text.partition(":")
    cfg = {"name": name, "threads": None, "env": {}}
    for item in filter(None, body.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise SystemExit(f"error: configuration item {item!r} in {text!r} is not KEY=VALUE")
        if key.isupper():
            cfg["env"][key] = value
        elif key == "threads":
            cfg["threads"] = int(value)
        else:
            raise SystemExit(f"error: unknown key {key!r} in {text!r}: use threads=N or an upper-case "
                             "environment variable")
    return cfg


# -- the subprocess ------------------------------------------------------------------------------
def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc (seconds)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _decode(llm, n: int) -> dict:
    """One greedy generation of n tokens: decode speed, CPU per token, thread counts used."""
    import torch

    counts = []
    share = llm.cpu_share
    tick = share.tick
    share.tick = lambda: (tick(), counts.append(torch.get_num_threads()))  # record each round's count
    try:
        cpu = time.process_time()
        out = llm.generate(PROMPT, max_new_tokens=n)
        cpu = time.process_time() - cpu
    finally:
        share.tick = tick
    tokens = out.stats["new_tokens"]
    decode_s = out.stats["total_s"] - out.stats["prefill_s"]
    return {"tok_s": tokens / decode_s, "cpu_s_per_token": cpu / tokens, "decode_s": decode_s,
            "mean_threads": sum(counts) / len(counts), "tokens": out.token_ids}


def child(cfg: dict, n: int, phases: list[str]) -> dict:
    """Load the model the way the configuration says; decode in each phase ("alone", "shared")."""
    import outrider
    import torch

    llm = outrider.LLM("smollm2-135m-instruct", threads=cfg["threads"])
    _decode(llm, 8)  # warm-up: allocator, thread pool, lazy inits
    result = {"threads": cfg["threads"] or f"auto (<= {torch.get_num_threads()})",
              "ceiling": torch.get_num_threads(), "share": type(llm.cpu_share).__name__}
    for phase in phases:
        neighbour = None
        if phase == "shared":
            neighbour = subprocess.Popen([sys.executable, "-c", NEIGHBOUR])
            time.sleep(0.3)  # let it start spinning
            before, wall = _cpu_seconds(neighbour.pid), time.perf_counter()
        try:
            result[phase] = _decode(llm, n)
            if neighbour is not None:
                got = _cpu_seconds(neighbour.pid) - before
                result[phase]["neighbour_cores"] = got / (time.perf_counter() - wall)
        finally:
            if neighbour is not None:
                neighbour.kill()
                neighbour.wait()
    outputs = [result[phase].pop("tokens") for phase in phases]
    result["same_tokens"] = all(o == outputs[0] for o in outputs)
    return result


# -- the parent ----------------------------------------------------------------------------------
def run_child(cfg: dict, n: int, phases: list[str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARIABLES}
    env.update({k: v for k, v in cfg["env"].items() if v != "unset"})
    args = [sys.executable, __file__, "--child", json.dumps(cfg), "--new-tokens", str(n), "--phases", ",".join(phases)]
    proc = subprocess.run(args, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"error: configuration {cfg['name']} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def busy_cores(seconds: float = 2.0) -> float:
    """Cores the machine's other work kept busy over the next `seconds` (from /proc/stat; we run
    nothing meanwhile)."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
        return sum(ticks[:8]), ticks[3] + ticks[4]  # all, idle + iowait

    total0, idle0 = sample()
    time.sleep(seconds)
    total1, idle1 = sample()
    return (os.cpu_count() or 1) * (1 - (idle1 - idle0) / max(1, total1 - total0))


def wait_until_quiet(limit: float | None, patience_s: float = 600) -> float:
    """Wait until other work keeps fewer than `limit` cores busy (or `patience_s` passes); return
    the cores it kept busy just before we start."""
    start = time.monotonic()
    busy = busy_cores()
    while limit is not None and busy >= limit and time.monotonic() - start < patience_s:
        busy = busy_cores(5.0)
    return busy


def fair_ratio(threads: int, cores: int) -> float:
    """Decode speed left when a neighbour owns one core and we keep the rest, relative to alone."""
    return min(1.0, (cores - 1) / threads)


def table(configs: list[dict], runs: dict[str, list[dict]], cores: int) -> str:
    if "shared" not in next(iter(runs.values()))[0]:
        return alone_table(configs, runs)
    lines = ["| config | threads | tok/s alone | tok/s with neighbour | ratio (each run) | fair ratio | "
             "CPU ms/token alone | with neighbour | neighbour's cores | threads with neighbour | "
             "others' busy cores | runs |", "|---" * 12 + "|"]
    for cfg in configs:
        rs = runs[cfg["name"]]
        med = lambda f: statistics.median(f(r) for r in rs)  # noqa: E731
        ratio = med(lambda r: r["shared"]["tok_s"] / r["alone"]["tok_s"])
        each = ", ".join(f"{r['shared']['tok_s'] / r['alone']['tok_s']:.2f}" for r in rs)
        lines.append(
            f"| {cfg['name']} | {rs[0]['threads']} | {med(lambda r: r['alone']['tok_s']):.1f} | "
            f"{med(lambda r: r['shared']['tok_s']):.1f} | {ratio:.2f} ({each}) | "
            f"{fair_ratio(cfg['threads'] or rs[0]['ceiling'], cores):.2f} | "
            f"{1000 * med(lambda r: r['alone']['cpu_s_per_token']):.0f} | "
            f"{1000 * med(lambda r: r['shared']['cpu_s_per_token']):.0f} | "
            f"{med(lambda r: r['shared']['neighbour_cores']):.2f} | {med(lambda r: r['shared']['mean_threads']):.2f} | "
            f"{med(lambda r: r['busy_cores_before']):.2f} | {len(rs)} |")
    return "\n".join(lines)


def alone_table(configs: list[dict], runs: dict[str, list[dict]]) -> str:
    base = configs[0]["name"]
    lines = [f"| config | threads | tok/s alone (median) | each run | vs {base} | CPU ms/token | "
             "others' busy cores (max) |", "|---" * 7 + "|"]
    base_speed = statistics.median(r["alone"]["tok_s"] for r in runs[base])
    for cfg in configs:
        rs = runs[cfg["name"]]
        speed = statistics.median(r["alone"]["tok_s"] for r in rs)
        each = ", ".join(f"{r['alone']['tok_s']:.1f}" for r in rs)
        cpu = statistics.median(r["alone"]["cpu_s_per_token"] for r in rs)
        busy = max(r["busy_cores_before"] for r in rs)
        lines.append(f"| {cfg['name']} | {rs[0]['threads']} | {speed:.1f} | {each} | {speed / base_speed:.2f} | "
                     f"{1000 * cpu:.0f} | {busy:.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("configs", nargs="*", default=DEFAULT_CONFIGS, help="NAME:KEY=VALUE,... (see the module doc)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--alone-only", action="store_true", help="no neighbour: compare the configurations' quiet speed")
    ap.add_argument("--max-busy", type=float, default=None,
                    help="before each run wait (up to 10 min) until other work keeps fewer cores than this busy")
    ap.add_argument("--json", default=None, help="write every raw figure here")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--phases", default="alone,shared", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child), args.new_tokens, args.phases.split(","))))
        return

    configs = [parse_config(c) for c in args.configs]
    cores = os.cpu_count() or 1
    loads = [uptime()]
    print(f"{cores} cores; before: {loads[0]}", flush=True)
    runs: dict[str, list[dict]] = {c["name"]: [] for c in configs}
    for rep in range(args.repeats):
        for cfg in configs:
            phases = ["alone"] if args.alone_only else (["alone", "shared"] if rep % 2 == 0 else ["shared", "alone"])
            r = {"busy_cores_before": wait_until_quiet(args.max_busy)}
            r |= run_child(cfg, args.new_tokens, phases)
            r["load_after"] = os.getloadavg()[0]
            runs[cfg["name"]].append(r)
            speeds = ", ".join(f"{p} {r[p]['tok_s']:.1f} tok/s ({r[p]['mean_threads']:.2f} threads)" for p in phases)
            print(f"  repeat {rep + 1} {cfg['name']}: {speeds}; others busy {r['busy_cores_before']:.2f} cores "
                  f"before, load {r['load_after']:.2f} after; same tokens {r['same_tokens']}", flush=True)
    loads.append(uptime())
    print(f"after: {loads[1]}\n")
    print(table(configs, runs, cores))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cores": cores, "uptime": loads, "new_tokens": args.new_tokens, "configs": configs,
                       "runs": runs}, f, indent=2)


if __name__ == "__main__":
    main()
