"""The cluster's /metrics: every replica's series with a `replica` label, their sums, and the router's own.

Each replica keeps the single server's metrics (serve/metrics.py). The front end gathers their
expositions when /metrics is read and writes each series twice: once per replica with
`replica="i"`, and once summed over the replicas without that label, so a dashboard made for
one server reads the whole cluster's totals unchanged (select `{replica!=""}` for the
per-replica series; summing both would count twice). Histograms are summed bucket by bucket.

A replica that has died keeps the counters and histograms it last reported, so totals never go
down; its gauges (running, waiting, K/V rows) are dropped. A restarted replica's new actor counts
from zero: its series are added to what the actors before it in that slot last reported, so a
slot's counters never go down either. The router's own series:

    outrider:cluster_replicas{state}                     replicas alive, restarting and dead
    outrider:cluster_requests_waiting{replica}           requests held by the router for a free slot there
    outrider:cluster_replica_deaths_total{replica}       replicas seen to die (each once)
    outrider:cluster_replica_restarts_total{replica}     new actors started in a dead replica's slot
    outrider:cluster_requests_routed_total{replica,reason}   requests sent, by the policy's reason
    outrider:cluster_requests_moved_total{replica,reason}    requests moved there while they ran or waited
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
        self.retired: dict[int, list[str]] = {}  # the last expositions of the actors a slot had before
        self.registry = r = CollectorRegistry()
        self.state = Gauge("outrider:cluster_replicas", "Replicas by state", ["state"], registry=r)
        self.waiting = Gauge("outrider:cluster_requests_waiting", "Requests held for a free slot of a replica",
                             ["replica"], registry=r)
        self.deaths = Counter("outrider:cluster_replica_deaths", "Replicas seen to die", ["replica"], registry=r)
        self.restarts = Counter("outrider:cluster_replica_restarts", "New actors started in a dead replica's slot",
                                ["replica"], registry=r)
        self.moved = Counter("outrider:cluster_requests_moved", "Requests moved to a replica while they ran or waited",
                             ["replica", "reason"], registry=r)
        self.routed = Counter("outrider:cluster_requests_routed", "Requests sent to a replica",
                              ["replica", "reason"], registry=r)
        self.retried = Counter("outrider:cluster_requests_retried", "Requests re-sent after their replica died",
                               registry=r)
        self.failed = Counter("outrider:cluster_requests_failed", "Requests the cluster failed", ["reason"],
                              registry=r)
        self.replicas_now(len(replicas), 0)
        for i in range(len(replicas)):
            self.waiting.labels(str(i)).set(0)

    def replicas_now(self, alive: int, dead: int, restarting: int = 0) -> None:
        self.state.labels("alive").set(alive)
        self.state.labels("dead").set(dead)
        self.state.labels("restarting").set(restarting)

    def restarted(self, index: int) -> None:
        """A new actor took slot `index`: what the old one last reported stays in the slot's totals."""
        if index in self.last:
            self.retired.setdefault(index, []).append(self.last.pop(index))
        self.restarts.labels(str(index)).inc()

    async def exposition(self) -> bytes:
        live = set(self.alive())
        refs = {i: self.replicas[i].metrics_text.remote() for i in sorted(live)}
        for i, ref in refs.items():
            try:
                self.last[i] = (await asyncio.wait_for(ref, SCRAPE_TIMEOUT)).decode()
            except Exception:  # died or slow since: its last exposition stands (gauges dropped below)
                live.discard(i)
        return generate_latest(self.registry) + merge(self.last, live, self.retired).encode()


def merge(texts: dict[int, str], live: set[int], retired: dict[int, list[str]] | None = None) -> str:
    """Per-replica series (label replica="i") and their sums (no replica label), in Prometheus text.
    Gauges come from `live` replicas only; `_created` series are left out (a sum of them means
    nothing); `retired`: a slot's earlier actors' last texts, added into that slot's series."""
    sources = [(i, text, i in live) for i, text in sorted(texts.items())]
    sources += [(i, text, False) for i, old in sorted((retired or {}).items()) for text in old]
    families: dict[str, tuple[str, str, str]] = {}  # name -> (exposed name, type, help)
    per: dict[str, dict[tuple, float]] = defaultdict(dict)  # name -> {(sample, labels + replica): value}
    sums: dict[str, dict[tuple, float]] = defaultdict(dict)  # name -> {(sample, labels): value}
    for index, text, is_live in sources:
        for family in text_string_to_metric_families(text):
            if family.name.endswith("_created") or (family.type == "gauge" and not is_live):
                continue
            shown = family.name + "_total" if family.type == "counter" else family.name
            families.setdefault(family.name, (shown, family.type, family.documentation))
            for s in family.samples:
                if s.name.endswith("_created"):
                    continue
                mine = (s.name, tuple(s.labels.items()) + (("replica", str(index)),))
                per[family.name][mine] = per[family.name].get(mine, 0.0) + s.value
                key = (s.name, tuple(sorted(s.labels.items())))
                sums[family.name][key] = sums[family.name].get(key, 0.0) + s.value
    lines = []
    for name, (shown, kind, doc) in families.items():
        lines += [f"# HELP {shown} {doc}", f"# TYPE {shown} {kind}"]
        lines += [_line(sample, dict(labels), value) for (sample, labels), value in per[name].items()]
        lines += [_line(sample, dict(labels), value) for (sample, labels), value in sums[name].items()]
    return "\n".join(lines) + "\n" if lines else ""


def _line(name: str, labels: dict, value: float) -> str:
    escape = lambda v: v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')  # noqa: E731
    inner = ",".join(f'{k}="{escape(v)}"' for k, v in labels.items())
    return f"{name}{{{inner}}} {value!r}" if inner else f"{name} {value!r}"
