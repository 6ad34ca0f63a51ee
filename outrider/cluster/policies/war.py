"""WAR: suffix decoding while the cluster is lightly loaded, cache-aware routing when it is busy.

At low load (running + queued over the live replicas' slots below `busy`) every request goes
to the least-loaded replica and speculates: suffix decoding costs little where batches are
small. At high load a wide verify costs the whole batch (control/batch_cost.py), so drafting
only pays where acceptance is high: a request goes to the replica holding the longest cached
prefix of its prompt (policies/prefix.py: at least `min_tokens`; its prefix cache skips that
much prefill, and its suffix index holds the conversation's history) and speculates there, or
else, when its session was served by a replica, to that one; either unless that replica is more
than `slack` sequences busier than the least-loaded one. A request with no such home decodes
plainly on the least-loaded replica. Every prompt is remembered where it went, at any load.

    --policy war[:busy=FRACTION,slack=N,min_tokens=N]

Decision reasons: "low-load", "prefix", "session", "plain".
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...errors import ConfigError
from ..policy import Decision, Outcome, PolicyBase, ReplicaView, RequestInfo, alive
from ..prefix_index import BLOCK
from .least_load import least_loaded
from .prefix import PrefixHomes


@dataclass
class WAR(PolicyBase):
    name: str = "war"
    busy: float = 0.5  # utilisation (load over slots) from which the cluster counts as busy
    slack: int = 4  # extra load a session's home may carry over the least-loaded replica
    min_tokens: int = BLOCK  # a cached prefix this long makes a replica a request's home
    homes: PrefixHomes = field(default_factory=PrefixHomes)  # what each replica's prefix cache holds

    def route(self, request: RequestInfo, replicas: list[ReplicaView], now: float) -> Decision:
        decision = self._choose(request, replicas)
        self.homes.sent(decision.replica, request)
        return decision

    def _choose(self, request: RequestInfo, replicas: list[ReplicaView]) -> Decision:
        live = alive(replicas)
        least = least_loaded(live)
        cached, _ = self.homes.home(request, replicas, self.min_tokens)  # forgets the dead too
        utilisation = sum(r.load for r in live) / max(sum(r.max_running for r in live), 1)
        if utilisation < self.busy:
            return Decision(least.index, True, request.arrived, "low-load")
        if cached is not None and cached.load <= least.load + self.slack:
            return Decision(cached.index, True, request.arrived, "prefix")
        if request.session is not None:
            homes = [r for r in live if request.session in r.sessions]
            if homes:
                home = min(homes, key=lambda r: (r.load, r.index))
                if home.load <= least.load + self.slack:
                    return Decision(home.index, True, request.arrived, "session")
        return Decision(least.index, False, request.arrived, "plain")

    def observe(self, outcome: Outcome) -> None:
        if outcome.error is None:  # a retry or a move may have ended it elsewhere
            self.homes.sent(outcome.replica, outcome.request)


def make(options: dict) -> WAR:
    unknown = set(options) - {"busy", "slack", "min_tokens"}
    if unknown:
        raise ConfigError(f"policy war: unknown option {sorted(unknown)[0]!r} (options: busy, slack, min_tokens)")
    try:
        busy, slack = float(options.get("busy", 0.5)), int(options.get("slack", 4))
        min_tokens = int(options.get("min_tokens", BLOCK))
    except ValueError:
        raise ConfigError("policy war: busy takes a fraction (e.g. 0.5), slack and min_tokens integers") from None
    if busy < 0 or slack < 0 or min_tokens < 0:
        raise ConfigError(f"policy war: busy, slack and min_tokens must be >= 0, got {busy:g}, {slack} and "
                          f"{min_tokens}")
    return WAR(busy=busy, slack=slack, min_tokens=min_tokens, options=dict(options))
