"""sticky: a session's requests go back to the replica that served it, while it is alive and not
overloaded; otherwise (a new session, or its replica dead or busy) to the least-loaded replica.

A session is the OpenAI `user` field or an `X-Session-Id` header (`RequestInfo.session`); a
replica's `ReplicaView.sessions` are the sessions sent to it. Keeping a conversation on one
replica keeps what that replica learnt of it (a suffix drafter's index of its earlier turns). A
replica is overloaded for this purpose when its load (running + queued) is more than `max_skew`
above the least-loaded live replica's: then the session moves, and stays where it moved.

    --policy sticky                 max_skew 4
    --policy sticky:max_skew=8
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import ConfigError
from ..policy import Decision, PolicyBase, ReplicaView, RequestInfo, alive
from .least_load import least_loaded

DEFAULT_MAX_SKEW = 4


@dataclass
class Sticky(PolicyBase):
    name: str = "sticky"
    max_skew: int = DEFAULT_MAX_SKEW

    def route(self, request: RequestInfo, replicas: list[ReplicaView], now: float) -> Decision:
        fallback = least_loaded(replicas)
        if request.session is None:
            return Decision(fallback.index, reason="least-load")
        holders = [r for r in alive(replicas) if request.session in r.sessions]
        if holders:
            home = min(holders, key=lambda r: (r.load, r.index))
            if home.load <= fallback.load + self.max_skew:
                return Decision(home.index, reason="sticky")
            return Decision(fallback.index, reason="moved")  # its replica is too busy
        return Decision(fallback.index, reason="new-session")


def make(options: dict) -> Sticky:
    unknown = set(options) - {"max_skew"}
    if unknown:
        raise ConfigError(f"--policy sticky takes max_skew=N, got {', '.join(sorted(unknown))}")
    text = options.get("max_skew", str(DEFAULT_MAX_SKEW))
    try:
        skew = int(text)
    except ValueError:
        skew = -1
    if skew < 0:
        raise ConfigError(f"--policy sticky: max_skew must be an integer >= 0, got {text!r}")
    return Sticky(options=dict(options), max_skew=skew)
