"""A simulation's figures, as the load test reports a real run's, and the plots of a sweep.

    summarize(result) -> {"throughput_tok_s", "e2e_s": {p50, p99, mean}, "ttft_s": ..., "makespan_s",
                          "running_per_replica", "requests", "moved", "decisions"}

Throughput is output tokens over the wall time from the first arrival to the last end (as
serve_load.summarize: first send to last end); latencies are end to end and to the first token;
`running_per_replica` is the time-weighted mean of sequences holding a slot, per replica, over
the replicas' busy time (BALANCE's figure: how many sequences fit under the memory limit).
"""

from __future__ import annotations

from ...bench.serve_load import percentiles
from .engine import SimResult


def summarize(result: SimResult, start: float | None = None) -> dict:
    """start: the clock's origin for the wall time (a replayed phase: 0, its start; None: the first arrival)."""
    jobs = [j for j in result.jobs if j.finished is not None]
    if start is None:
        start = min((j.arrived for j in result.jobs), default=0.0)
    end = max((j.finished for j in jobs), default=start)
    wall = end - start
    tokens = sum(j.req.output_tokens for j in jobs)
    busy = sum(result.replica_busy_s)
    return {
        "workload": result.workload, "policy": result.policy, "replicas": result.replicas,
        "requests": len(result.jobs), "finished": len(jobs), "output_tokens": tokens,
        "wall_s": wall, "makespan_s": wall, "throughput_tok_s": tokens / wall if wall > 0 else 0.0,
        "e2e_s": percentiles([j.finished - j.arrived for j in jobs]),
        "ttft_s": percentiles([j.first_token - j.arrived for j in jobs if j.first_token is not None]),
        "running_per_replica": sum(result.replica_seq_s) / busy if busy > 0 else 0.0,
        "speculated": sum(j.speculate for j in jobs), "moved": sum(j.moves > 0 for j in jobs),
        "decisions": dict(sorted(result.decisions.items())),
    }


def table(rows: list[dict]) -> str:
    """Summaries as a markdown table."""
    out = ["| workload | policy | replicas | requests | tok/s | e2e p50 / p99 (s) | mean (s) | makespan (s) "
           "| running/replica | speculated | moved |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in rows:
        e = s["e2e_s"]
        out.append(f"| {s['workload']} | {s['policy']} | {s['replicas']} | {s['finished']}/{s['requests']} | "
                   f"{s['throughput_tok_s']:.1f} | {_f(e['p50'])} / {_f(e['p99'])} | {_f(e['mean'])} | "
                   f"{s['makespan_s']:.2f} | {s['running_per_replica']:.2f} | {s['speculated']} | {s['moved']} |")
    return "\n".join(out)


def _f(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def plot_sweep(rows: list[dict], path, title: str) -> None:
    """Throughput and p50/p99 latency against replicas, one line per policy (log-scaled replicas)."""
    from matplotlib.figure import Figure

    policies = sorted({s["policy"] for s in rows})
    fig = Figure(figsize=(13, 4))
    axes = fig.subplots(1, 3)
    for name in policies:
        mine = sorted((s for s in rows if s["policy"] == name), key=lambda s: s["replicas"])
        xs = [s["replicas"] for s in mine]
        axes[0].plot(xs, [s["throughput_tok_s"] for s in mine], marker="o", label=name)
        axes[1].plot(xs, [s["e2e_s"]["p50"] for s in mine], marker="o", label=name)
        axes[2].plot(xs, [s["e2e_s"]["p99"] for s in mine], marker="o", label=name)
    for ax, what in zip(axes, ("output tokens/s", "e2e latency p50 (s)", "e2e latency p99 (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("replicas (simulated)")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
