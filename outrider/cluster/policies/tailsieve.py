"""TailSieve: in an RL rollout batch, spot the long tail early and move it to low-latency replicas.

    --policy tailsieve[:tail=FRACTION,fast=K]

The replicas fall in two sets: the bulk (plain decoding, large batches: throughput) and the
low-latency set (speculating, small batches). The low-latency set is the first `fast` replicas
(`outrider serve --replicas N`, where every replica runs the same engine: their roles are the
policy's, so bulk requests decode plainly and moved ones speculate), or, with `fast=0` (the
default), the replicas whose `ReplicaView.speculative` is True (the simulator's low-latency
replicas). Every request of a rollout group (`RequestInfo.group`: the `X-Rollout-Group` header,
samples of the same prompts) goes to the least-loaded bulk replica. Once a `tail` fraction of a
group has finished, the members still on bulk replicas are its long tail: they decide the
batch's makespan, so they are moved to the least-loaded low-latency replicas (those with a free
slot), where each of them commits tokens faster.

Moving is `moves(running, replicas, now)`, which the router (moves.py) and the simulator call
after a request of a group ends, with the group's unfinished requests as (RequestInfo, replica
index, tokens so far); it returns (request id, Decision) pairs. A move costs the prompt and the
output so far prefilled again on the new replica; the request continues from its committed
tokens (the router: cancelled on its replica and continued on the target, its client's stream
unbroken).

Decision reasons: "bulk", "tail".
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...errors import ConfigError
from ..policy import Decision, Outcome, PolicyBase, ReplicaView, RequestInfo, alive
from .least_load import least_loaded


@dataclass
class TailSieve(PolicyBase):
    name: str = "tailsieve"
    tail: float = 0.5  # the fraction of a group that, once finished, marks the rest as its tail
    fast: int = 0  # the first `fast` replicas are the low-latency set (0: those whose views speculate)
    sizes: dict = field(default_factory=dict)  # group -> requests routed
    finished: dict = field(default_factory=dict)  # group -> requests ended

    def is_fast(self, replica: ReplicaView) -> bool:
        return replica.index < self.fast if self.fast else replica.speculative

    def route(self, request: RequestInfo, replicas: list[ReplicaView], now: float) -> Decision:
        live = alive(replicas)
        bulk = [r for r in live if not self.is_fast(r)] or live
        best = least_loaded(bulk)
        if request.group is not None:
            self.sizes[request.group] = self.sizes.get(request.group, 0) + 1
        plain = False if self.fast and not self.is_fast(best) else None  # roles by index: the bulk decodes plainly
        return Decision(best.index, plain, request.arrived, "bulk")

    def observe(self, outcome: Outcome) -> None:
        group = outcome.request.group
        if group is not None:
            self.finished[group] = self.finished.get(group, 0) + 1

    def in_tail(self, group: str | None) -> bool:
        if group is None or not self.sizes.get(group):
            return False
        return self.finished.get(group, 0) >= self.tail * self.sizes[group]

    def moves(self, running: list[tuple[RequestInfo, int, float]], replicas: list[ReplicaView],
              now: float) -> list[tuple[str, Decision]]:
        """The tail members on bulk replicas, each to the least-loaded low-latency replica with a slot."""
        fast = {r.index: r for r in replicas if r.alive and self.is_fast(r)}
        slow = {r.index for r in replicas if not self.is_fast(r)}
        if not fast:
            return []
        load = {i: r.load for i, r in fast.items()}  # counted as moves are decided
        out = []
        for request, at, _done in running:
            if at not in slow or not self.in_tail(request.group):
                continue
            free = [i for i in fast if load[i] < fast[i].max_running]
            if not free:
                break
            target = min(free, key=lambda i: (load[i], i))
            load[target] += 1
            out.append((request.id, Decision(target, True, request.arrived, "tail")))
        return out


def make(options: dict) -> TailSieve:
    unknown = set(options) - {"tail", "fast"}
    if unknown:
        raise ConfigError(f"policy tailsieve: unknown option {sorted(unknown)[0]!r} (options: tail, fast)")
    try:
        tail = float(options.get("tail", 0.5))
        fast = int(options.get("fast", 0))
    except ValueError:
        raise ConfigError("policy tailsieve: tail takes a fraction (e.g. 0.5), fast a number of replicas") from None
    if not 0 < tail <= 1:
        raise ConfigError(f"policy tailsieve: tail must be in (0, 1], got {tail:g}")
    if fast < 0:
        raise ConfigError(f"policy tailsieve: fast must be >= 0 replicas, got {fast}")
    return TailSieve(tail=tail, fast=fast, options=dict(options))
