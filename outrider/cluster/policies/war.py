"""WAR: suffix decoding while the cluster is lightly loaded, cache-aware routing when it is busy.

    --policy war[:busy=FRACTION,slack=N]

At low load (running + queued over the live replicas' slots below `busy`) every request goes
to the least-loaded replica and speculates: suffix decoding costs little where batches are
small. At high load a wide verify costs the whole batch (control/batch_cost.py), so drafting
only pays where acceptance is high: a request whose session a replica already served goes
there (its suffix index, and any K/V it keeps, hold the conversation's history) and speculates,
unless that replica is more than `slack` sequences busier than the least-loaded one; a request
with no such home decodes plainly on the least-loaded replica.

Decision reasons: "low-load", "session", "plain".
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import ConfigError
from ..policy import Decision, PolicyBase, ReplicaView, RequestInfo, alive
from .least_load import least_loaded


@dataclass
class WAR(PolicyBase):
    name: str = "war"
    busy: float = 0.5  # utilisation (load over slots) from which the cluster counts as busy
    slack: int = 4  # extra load a session's home may carry over the least-loaded replica

    def route(self, request: RequestInfo, replicas: list[ReplicaView], now: float) -> Decision:
        live = alive(replicas)
        least = least_loaded(live)
        utilisation = sum(r.load for r in live) / max(sum(r.max_running for r in live), 1)
        if utilisation < self.busy:
            return Decision(least.index, True, request.arrived, "low-load")
        if request.session is not None:
            homes = [r for r in live if request.session in r.sessions]
            if homes:
                home = min(homes, key=lambda r: (r.load, r.index))
                if home.load <= least.load + self.slack:
                    return Decision(home.index, True, request.arrived, "session")
        return Decision(least.index, False, request.arrived, "plain")


def make(options: dict) -> WAR:
    unknown = set(options) - {"busy", "slack"}
    if unknown:
        raise ConfigError(f"policy war: unknown option {sorted(unknown)[0]!r} (options: busy, slack)")
    try:
        busy, slack = float(options.get("busy", 0.5)), int(options.get("slack", 4))
    except ValueError:
        raise ConfigError("policy war: busy takes a fraction (e.g. 0.5), slack an integer") from None
    if busy < 0 or slack < 0:
        raise ConfigError(f"policy war: busy and slack must be >= 0, got {busy:g} and {slack}")
    return WAR(busy=busy, slack=slack, options=dict(options))
