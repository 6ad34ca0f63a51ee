"""What the simulator replays: requests with what they will do, and the replicas they meet.

A `SimRequest` carries the policy's view of a request (`RequestInfo`) and what only the simulator
knows: how many tokens it will generate, and its acceptance when it speculates (tokens per round,
bonus included, and the draft tree's width in new tokens per round). A `Workload` is a list of
them, sent either open loop (each at its `arrived` time) or closed loop (`clients` clients, each
sending the next request of the list as soon as its last one ends, as serve_load.closed_loop
does), and the replicas' settings (`ReplicaSpec`).

Recorded runs replay as they were measured (`from_load_run`: one workload per phase of a
`scripts/load_test.py` results.json, each request's output tokens, rounds and drafts as the
server reported them). Synthetic workloads are in synth.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ...errors import ConfigError
from ..policy import RequestInfo


@dataclass(frozen=True)
class SimRequest:
    info: RequestInfo
    output_tokens: int  # what it generates (EOS or max_tokens): known to the simulator only
    tau: float = 1.0  # tokens a round when it speculates (bonus included)
    width: float = 1.0  # new tokens a round's tree holds when it speculates (1 + drafts)
    tau_hit: float | None = None  # tau on a replica that holds its session's history (None: tau)
    speculate: bool | None = None  # a recorded request's own choice (speculate: false), overriding the policy's


@dataclass(frozen=True)
class ReplicaSpec:
    """A simulated replica's settings (the serve options it stands for)."""

    max_running: int = 16  # --max-running
    kv_rows_total: int = 16 * 2048  # --max-kv-rows (default: every slot full)
    chunk_size: int = 512  # --chunk-size
    speculative: bool = True  # drafts by default (--drafter given)
    tree_rows: int = 8  # K/V rows a speculating sequence reserves for one round's tree
    draft_kv: float = 0.0  # extra K/V rows per target row a speculating sequence holds (a draft model's cache)
    low_latency: int = 0  # the first this many replicas are TailSieve's low-latency set ...
    low_latency_max_running: int = 4  # ... with this --max-running, speculating


@dataclass
class Workload:
    name: str
    requests: list[SimRequest]
    clients: int | None = None  # closed loop with this many clients; None: open loop at `arrived`
    replica: ReplicaSpec = field(default_factory=ReplicaSpec)
    kind: str = "serve"  # "rollout": the figure is the batch's makespan
    measured: dict = field(default_factory=dict)  # a recorded run's own figures, to compare with


def from_load_run(path: str | Path, replica: ReplicaSpec | None = None) -> list[Workload]:
    """One closed- or open-loop workload per timed phase of a load test's results.json (or of a
    trimmed copy holding `plan` and `phases` with their `records`)."""
    raw = _read_json(path, "load-test results")
    try:
        phases = [p for p in raw["phases"] if p["kind"] in ("closed", "open")]
        max_running = max(raw["plan"]["concurrency"])
        chunk = int(raw["plan"].get("chunk_size", 512))
    except (KeyError, TypeError, ValueError):
        raise ConfigError(f"{path}: not a load test's results.json (no plan/phases)") from None
    replica = replica or ReplicaSpec(max_running=max_running, kv_rows_total=max_running * 2048, chunk_size=chunk)
    out = []
    for p in phases:
        requests = []
        for r in sorted((r for r in p["records"] if r["outcome"] == "ok"), key=lambda r: r["index"]):
            spec = p["mode"] == "on" and r["rounds"] > 0
            tau = r["output_tokens"] / r["rounds"] if spec else 1.0
            width = 1.0 + r["drafted"] / r["rounds"] if spec else 1.0
            info = RequestInfo(f"{p['mode']}-{r['index']}", r["prompt_tokens"], raw["plan"]["max_tokens"],
                               r["sent"], workload=raw["plan"].get("workload"))
            requests.append(SimRequest(info, r["output_tokens"], tau, width, speculate=spec))
        what = f"closed c={p['concurrency']}" if p["kind"] == "closed" else f"open {p['rate']:g}/s"
        measured = {"throughput_tok_s": p["throughput_tok_s"], "e2e_p50_s": p["e2e_s"]["p50"],
                    "ttft_p50_s": p["ttft_s"]["p50"], "wall_s": p["wall_s"], "tau": p.get("tau")}
        out.append(Workload(f"{what} spec {p['mode']}", requests, p["concurrency"] if p["kind"] == "closed" else None,
                            replica, measured=measured))
    if not out:
        raise ConfigError(f"{path}: no closed- or open-loop phase to replay")
    return out


def trim_load_run(raw: dict, keep=("closed", "open")) -> dict:
    """A load test's results.json cut to what `from_load_run` reads (a test fixture of a few KB)."""
    fields = ("index", "sent", "outcome", "output_tokens", "prompt_tokens", "rounds", "drafted")
    phases = [{"kind": p["kind"], "mode": p["mode"], "concurrency": p["concurrency"], "rate": p["rate"],
               "throughput_tok_s": p["throughput_tok_s"], "wall_s": p["wall_s"], "tau": p.get("tau"),
               "e2e_s": p["e2e_s"], "ttft_s": p["ttft_s"],
               "records": [{k: r[k] for k in fields} for r in p["records"]]}
              for p in raw["phases"] if p["kind"] in keep]
    plan = {k: raw["plan"][k] for k in ("concurrency", "max_tokens", "workload", "chunk_size", "threads")}
    return {"plan": plan, "started": raw.get("started"), "server_command": raw.get("server_command"),
            "phases": phases}


def _read_json(path: str | Path, what: str) -> dict:
    try:
        raw = json.loads(Path(path).read_text())
    except OSError as err:
        raise ConfigError(f"{what} {path}: cannot read it ({err.strerror or err})") from None
    except ValueError as err:
        raise ConfigError(f"{what} {path}: not JSON ({err})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{what} {path}: a JSON object is expected")
    return raw
