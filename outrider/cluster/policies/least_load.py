"""least-load: the live replica with the fewest running + queued sequences; ties go to the lowest index.

vLLM's data-parallel default and the baseline every other policy is measured against. It knows
nothing of sessions or speculation: `Decision.speculate` stays None (each replica's default).

    --policy least-load
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import ConfigError
from ..policy import Decision, PolicyBase, ReplicaView, RequestInfo, alive


def least_loaded(replicas: list[ReplicaView]) -> ReplicaView:
    """The live replica with the smallest load (running + queued), the lowest index among equals."""
    return min(alive(replicas), key=lambda r: (r.load, r.index))


@dataclass
class LeastLoad(PolicyBase):
    name: str = "least-load"

    def route(self, request: RequestInfo, replicas: list[ReplicaView], now: float) -> Decision:
        return Decision(least_loaded(replicas).index, reason="least-load")


def make(options: dict) -> LeastLoad:
    if options:
        raise ConfigError(f"--policy least-load takes no options, got {', '.join(options)}")
    return LeastLoad()
