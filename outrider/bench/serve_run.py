"""A serving load benchmark, end to end: start `outrider serve`, load it, check it, judge the goals.

    plan = LoadPlan(model=None, concurrency=(1, 4, 16, 32), rates=(0.5, 1.0), ...)
    results = run_load(plan, out)        # results.json-ready dict; server.log in `out`

The server runs in a subprocess on a free loopback port, with the drafter and controller of
the plan and `--max-running` = the largest concurrency (so closed-loop clients never queue
behind a slot limit). Speculation off and on are the same server: "off" phases send
`speculate: false` with every request (plain decoding, one token per round), "on" phases
send nothing extra. Off and on alternate phase by phase, so both see the same load of this
shared machine, the same prompts in the same order, and the same process.

Each off/on pair takes fresh prompts (the next ones of the workload's seeded order): the
suffix drafter keeps the outputs of finished requests, and greedy outputs repeat, so a prompt
sent again with speculation on would be drafted from its own earlier answer. "Off" requests
feed no drafter. Only when a run needs more prompts than the workload has does it start over
(the phase's `prompts_reused` says so).

After every phase the server's /metrics must agree with what the client counted (requests
ended normally = ok requests, output tokens equal, nothing left running or waiting): the
`metrics` field of each phase says whether they did.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from ..errors import ConfigError
from .serve_load import Target, closed_loop, open_loop, records_json, summarize
from .workloads import load_workload

MODES = ("off", "on")


@dataclass(frozen=True)
class LoadPlan:
    model: str | None = None  # catalog name or folder (None: the default model)
    drafter: str = "suffix"
    controller: str = "cost"
    tree: str = "chain"
    workload: str = "humaneval"
    prompts: int | None = None  # the workload's first N prompts (None: all)
    max_tokens: int = 32
    concurrency: tuple[int, ...] = (1, 4, 16, 32)
    rates: tuple[float, ...] = (0.5, 1.0)  # open-loop arrivals per second
    requests: int = 64  # at most this many requests per phase ...
    phase_s: float = 10.0  # ... and none sent after this many seconds ...
    min_requests: int = 1  # ... once a closed-loop phase has sent this many
    soak_s: float = 0.0  # closed loop at the largest concurrency, speculation on, this long (0: none)
    modes: tuple[str, ...] = MODES
    threads: int | None = None
    device: str | None = "cpu"
    chunk_size: int = 512
    request_timeout: float = 300.0
    seed: int = 0
    server_args: tuple[str, ...] = ()  # more `outrider serve` flags, e.g. ("--no-prefix-cache",)
    repeats: int = 1  # off/on pairs per closed-loop level, every other one on first (their figures pooled)

    def check(self) -> "LoadPlan":
        for name in ("prompts", "max_tokens", "requests", "min_requests", "repeats"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(self, name)}")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ConfigError(f"--concurrency needs positive integers, got {list(self.concurrency)}")
        if any(r <= 0 for r in self.rates):
            raise ConfigError(f"--rates must be positive (requests per second), got {list(self.rates)}")
        if self.phase_s <= 0 or self.soak_s < 0 or self.request_timeout <= 0:
            raise ConfigError("--phase-time and --request-timeout must be positive, --soak at least 0")
        if not self.modes or any(m not in MODES for m in self.modes):
            raise ConfigError(f"--modes takes off and/or on, got {list(self.modes)}")
        return self


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`outrider serve` in a subprocess on 127.0.0.1; stderr goes to `log_path`."""

    def __init__(self, plan: LoadPlan, log_path: Path, start_timeout: float = 300.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "outrider.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--max-running", str(max(plan.concurrency)), "--max-queue", str(max(plan.requests, 256)),
               "--chunk-size", str(plan.chunk_size), "--tree", plan.tree, "--controller", plan.controller]
        for flag, value in (("--model", plan.model), ("--drafter", plan.drafter), ("--threads", plan.threads),
                            ("--device", plan.device)):
            if value is not None:
                cmd += [flag, str(value)]
        cmd += list(plan.server_args)
        self.command = cmd
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        self._wait_healthy(start_timeout)

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while True:
            if self.proc.poll() is not None:
                self._log.close()
                tail = self.log_path.read_text().strip().splitlines()[-1:] or ["(no output)"]
                raise ConfigError(f"outrider serve exited with status {self.proc.returncode}: {tail[0]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                self.stop()
                raise ConfigError(f"outrider serve did not answer /health within {timeout:g} s (see {self.log_path})")
            time.sleep(0.2)

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM (the server drains, then exits 0); returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


# ---- /metrics ---------------------------------------------------------------------------------

def scrape(url: str) -> dict[str, float]:
    """The server's metrics as {'name{labels}': value}, histograms' buckets left out."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        m = re.match(r"^(outrider:[a-z_]+)(\{[^}]*\})? (\S+)$", line)
        if m and not m.group(1).endswith("_bucket"):
            labels = re.sub(r'model_name="[^"]*",?', "", m.group(2) or "").replace("{}", "")
            out[m.group(1) + labels] = float(m.group(3))
    return out


def _metric(values: dict[str, float], name: str, label: str = "") -> float:
    return sum(v for k, v in values.items() if k.split("{")[0] == name and label in k)


def metrics_check(url: str, before: dict, summary: dict, wait_s: float = 5.0) -> dict:
    """Compare the server's counters over a phase with the client's counts. The engine thread
    records a request's metrics just after sending its end, so this polls briefly for them."""
    deadline = time.time() + wait_s
    while True:
        after = scrape(url)

        def delta(name, label=""):
            return _metric(after, name, label) - _metric(before, name, label)

        ended = delta("outrider:request_success_total")
        aborted = delta("outrider:request_success_total", 'finished_reason="abort"')
        check = {"ended_normally": ended - aborted, "aborted": aborted,
                 "generation_tokens": delta("outrider:generation_tokens_total"),
                 "running_after": _metric(after, "outrider:num_requests_running"),
                 "waiting_after": _metric(after, "outrider:num_requests_waiting")}
        check["agree"] = (check["ended_normally"] == summary["ok"]
                          and check["generation_tokens"] == summary["output_tokens"]
                          and check["running_after"] == 0 and check["waiting_after"] == 0)
        if check["agree"] or time.time() > deadline:
            return check
        time.sleep(0.1)


# ---- phases -----------------------------------------------------------------------------------

def _phase(server: ServerProcess, target: Target, kind: str, level: float, plan: LoadPlan,
           mode: str, time_limit: float, max_requests: int, log) -> dict:
    target.extra = {} if mode == "on" else {"speculate": False}
    before = scrape(server.url)
    cpu = server_cpu_s(server.proc.pid)
    if kind != "open":  # closed, warmup, soak
        least = min(plan.min_requests, max_requests)
        records, wall = asyncio.run(closed_loop(target, int(level), max_requests, time_limit, least))
    else:
        records, wall = asyncio.run(open_loop(target, level, max_requests, time_limit, plan.seed))
    summary = summarize(records, wall)
    if cpu is not None:  # the server's CPU time over the phase: less moved by other processes' load than wall time
        summary["server_cpu_s"] = server_cpu_s(server.proc.pid) - cpu
    phase = {"kind": kind, "mode": mode, "concurrency": int(level) if kind != "open" else None,
             "rate": level if kind == "open" else None, "time_limit_s": time_limit,
             "max_requests": max_requests, "first_prompt": target.offset % len(target.prompts),
             "prompts_reused": target.offset + len(records) > len(target.prompts), **summary,
             "metrics": metrics_check(server.url, before, summary), "records": records_json(records)}
    what = f"c={int(level)}" if kind != "open" else f"{level:g}/s"
    log(f"  {kind:6} {what:7} spec {mode:3}: {summary['ok']}/{summary['requests']} ok, "
        f"{summary['errors']} errors, {summary['lost']} lost, {summary['throughput_tok_s']:.1f} tok/s, "
        f"TTFT p50 {_fmt(summary['ttft_s']['p50'])} s, TPOT p50 {_fmt(summary['tpot_s']['p50'], 1000)} ms, "
        f"metrics {'agree' if phase['metrics']['agree'] else 'DISAGREE'}")
    return phase


def server_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of process `pid`, all its threads (Linux /proc; None elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _fmt(x, scale=1.0) -> str:
    return "-" if x is None else f"{x * scale:.2f}"


def load_prompts(plan: LoadPlan) -> tuple[list, bool, str]:
    """The workload's first `plan.prompts` prompts (texts or message lists), chat mode, source."""
    workload = load_workload(plan.workload, limit=plan.prompts, seed=plan.seed)
    prompts = [p.messages if workload.chat else p.text for p in workload.prompts]
    return prompts, workload.chat, workload.source


def run_load(plan: LoadPlan, out: Path, log=print) -> dict:
    plan.check()
    prompts, chat, source = load_prompts(plan)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    load_before = os.getloadavg()
    server = ServerProcess(plan, out / "server.log")
    phases = []
    try:
        log(f"outrider serve on {server.url} (pid {server.proc.pid}); load average {load_before[0]:.2f}")
        target = Target(server.url, prompts, chat, plan.max_tokens, request_timeout=plan.request_timeout)

        def pair(kind, level, time_limit, max_requests, modes=plan.modes):
            """Off then on (as asked) over the same fresh prompts; then move past them."""
            done = [_phase(server, target, kind, level, plan, mode, time_limit, max_requests, log) for mode in modes]
            target.offset += max(p["requests"] for p in done)
            return done

        pair("warmup", 1, plan.phase_s, 1)  # first-call costs and the cost controller's profile
        for c in plan.concurrency:
            for k in range(plan.repeats):  # every other pair the other way round: both see the drift of load
                phases += pair("closed", c, plan.phase_s, plan.requests, modes=plan.modes[::1 if k % 2 == 0 else -1])
        for rate in plan.rates:
            phases += pair("open", rate, plan.phase_s, plan.requests)
        if plan.soak_s > 0:
            phases += pair("soak", max(plan.concurrency), plan.soak_s, 10 ** 9, modes=plan.modes[-1:])
    finally:
        exit_status = server.stop()
    return {"plan": asdict(plan), "workload_source": source, "server_command": server.command,
            "server_exit_status": exit_status, "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
            "wall_s": time.time() - started, "cpus": os.cpu_count(),
            "load_average": {"before": list(load_before), "after": list(os.getloadavg())},
            "phases": phases, "goals": goals(phases)}


# ---- goals (issue 8, item 7) ------------------------------------------------------------------

def _throughput(phases: list[dict], kind: str, level, mode: str, per: str = "wall_s") -> float | None:
    """Output tokens per second of wall time (per="wall_s") or of the server's CPU time
    ("server_cpu_s"), pooled over the matching phases (a level's repeats)."""
    key = "rate" if kind == "open" else "concurrency"
    match = [p for p in phases if p["kind"] == kind and p[key] == level and p["mode"] == mode and p["ok"]]
    seconds = sum(p.get(per) or 0.0 for p in match)
    return sum(p["output_tokens"] for p in match) / seconds if match and seconds > 0 else None


def _ratio(a, b) -> float | None:
    return None if a is None or not b else a / b


def goals(phases: list[dict]) -> dict:
    """Each goal with its measured value and whether it was met (None: not measured)."""
    def goal(value, at_least):
        return {"value": value, "goal": at_least, "met": None if value is None else value >= at_least}

    closed = sorted({p["concurrency"] for p in phases if p["kind"] == "closed"})
    out = {}
    for mode in MODES:
        out[f"scaling_c16_over_c1_spec_{mode}"] = goal(
            _ratio(_throughput(phases, "closed", 16, mode), _throughput(phases, "closed", 1, mode)), 4.0)
    on_off = {c: _ratio(_throughput(phases, "closed", c, "on"), _throughput(phases, "closed", c, "off"))
              for c in closed}
    out["spec_on_over_off_c1"] = goal(on_off.get(1), 1.4)
    out["spec_on_over_off_c32"] = goal(on_off.get(32), 0.95)
    out["spec_on_over_off_by_concurrency"] = on_off
    out["spec_on_over_off_by_concurrency_cpu"] = {  # tokens per server CPU second
        c: _ratio(_throughput(phases, "closed", c, "on", "server_cpu_s"),
                  _throughput(phases, "closed", c, "off", "server_cpu_s")) for c in closed}
    soak = [p for p in phases if p["kind"] == "soak"]
    out["soak"] = ({"clients": soak[0]["concurrency"], "seconds": soak[0]["time_limit_s"],
                    "requests": soak[0]["requests"], "errors": soak[0]["errors"], "lost": soak[0]["lost"],
                    "met": soak[0]["errors"] == 0 and soak[0]["lost"] == 0 and soak[0]["metrics"]["agree"]}
                   if soak else {"met": None})
    timed = [p for p in phases if p["kind"] != "warmup"]
    out["no_errors_no_lost"] = {"errors": sum(p["errors"] for p in timed), "lost": sum(p["lost"] for p in timed),
                                "metrics_agree": all(p["metrics"]["agree"] for p in timed)}
    return out
