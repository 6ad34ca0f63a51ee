"""The cluster's /metrics: every replica's series with a `replica` label, their sums, and the router's own.

Each replica keeps the single server's metrics (serve/metrics.py). The front end gathers their
expositions when /metrics is read and writes each series twice: once per replica with
`replica="i"`, and once summed over the replicas without that label, so a dashboard made for
one server reads the whole cluster's totals unchanged (select `{replica!=""}` for the
per-replica series; summing both would count twice). Histograms are summed bucket by bucket.

A replica that has died keeps the counters and histograms it last reported, so totals never go
down; its gauges (running, waiting, K/V rows) are dropped. The router's own series:

    outrider:cluster_replicas{state}                     replicas alive and dead
    outrider:cluster_requests_waiting{replica}           requests held by the router for a free slot there
    outrider:cluster_replica_deaths_total{replica}       replicas seen to die (each once)
    outrider:cluster_requests_routed_total{replica,reason}   requests sent, by the policy's reason
    outrider:cluster_requests_retried_total              requests re-sent after their replica died
    outrider:cluster_requests_failed_total{reason}       requests failed by the cluster (replica_died, no_replica)
"""

from __future__ import annotations

import asyncio
from collections import defaultdict

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

SCRAPE_TIMEOUT = 5.0  # seconds a replica has to answer /metrics


class ClusterMetrics:
    def __init__(self, replicas: list, alive):
        """replicas: the Ray actor handles, by index; alive(): the indices alive now."""
        self.replicas = replicas
        self.alive = alive
        self.last: dict[int, str] = {}  # each replica's last exposition
        self.registry = r = CollectorRegistry()
        self.state = Gauge("outrider:cluster_replicas", "Replicas by state", ["state"], registry=r)
        self.waiting = Gauge("outrider:cluster_requests_waiting", "Requests held for a free slot of a replica",
                             ["replica"], registry=r)
        self.deaths = Counter("outrider:cluster_replica_deaths", "Replicas seen to die", ["replica"], registry=r)
        self.routed = Counter("outrider:cluster_requests_routed", "Requests sent to a replica",
                              ["replica", "reason"], registry=r)
        self.retried = Counter("outrider:cluster_requests_retried", "Requests re-sent after their replica died",
                               registry=r)
        self.failed = Counter("outrider:cluster_requests_failed", "Requests the cluster failed", ["reason"],
                              registry=r)
        self.replicas_now(len(replicas), 0)
        for i in range(len(replicas)):
            self.waiting.labels(str(i)).set(0)

    def replicas_now(self, alive: int, dead: int) -> None:
        self.state.labels("alive").set(alive)
        self.state.labels("dead").set(dead)

    async def exposition(self) -> bytes:
        live = set(self.alive())
        refs = {i: self.replicas[i].metrics_text.remote() for i in sorted(live)}
        for i, ref in refs.items():
            try:
                self.last[i] = (await asyncio.wait_for(ref, SCRAPE_TIMEOUT)).decode()
            except Exception:  # died or slow since: its last exposition stands (gauges dropped below)
                live.discard(i)
        return generate_latest(self.registry) + merge(self.last, live).encode()


def merge(texts: dict[int, str], live: set[int]) -> str:
    """Per-replica series (label replica="i") and their sums (no replica label), in Prometheus text.
    Gauges come from `live` replicas only; `_created` series are left out (a sum of them means nothing)."""
    families: dict[str, tuple[str, str, str]] = {}  # name -> (exposed name, type, help)
    samples: dict[str, list[tuple[str, dict, float, int]]] = defaultdict(list)
    for index, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            if family.name.endswith("_created") or (family.type == "gauge" and index not in live):
                continue
            shown = family.name + "_total" if family.type == "counter" else family.name
            families.setdefault(family.name, (shown, family.type, family.documentation))
            samples[family.name] += [(s.name, s.labels, s.value, index) for s in family.samples
                                     if not s.name.endswith("_created")]
    lines = []
    for name, (shown, kind, doc) in families.items():
        lines += [f"# HELP {shown} {doc}", f"# TYPE {shown} {kind}"]
        sums: dict[tuple, float] = {}
        for sample, labels, value, index in samples[name]:
            lines.append(_line(sample, {**labels, "replica": str(index)}, value))
            key = (sample, tuple(sorted(labels.items())))
            sums[key] = sums.get(key, 0.0) + value
        lines += [_line(sample, dict(labels), value) for (sample, labels), value in sums.items()]
    return "\n".join(lines) + "\n" if lines else ""


def _line(name: str, labels: dict, value: float) -> str:
    escape = lambda v: v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')  # noqa: E731
    inner = ",".join(f'{k}="{escape(v)}"' for k, v in labels.items())
    return f"{name}{{{inner}}} {value!r}" if inner else f"{name} {value!r}"
