"""The contract of a routing and scheduling policy: one request in, one `Decision` out.

The same policy object drives the real router (router.py, replicas as Ray actors) and the
simulator (sim/): it sees only these plain records, never Ray handles or engine objects, so a
policy measured in simulation is the code that routes in production.

A policy is called once per request when it arrives (`route`), and may be asked again to order
each replica's queue (`priority`: lower first, e.g. OUTLETS' shortest predicted job with aging).
It hears what happened (`observe`): the request finished on a replica with so many output tokens,
speculation on or off, acceptance tau; that is all it may learn from. A policy may also define
`moves(running, replicas, now) -> [(request id, Decision)]` (TailSieve): asked after a request of a
rollout group ends, it moves others of the group; the simulator and the router (moves.py) apply it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class RequestInfo:
    """What a policy knows of a request when it arrives."""

    id: str
    prompt_tokens: int
    max_tokens: int
    arrived: float  # seconds, on the router's (or simulator's) clock
    session: str | None = None  # the OpenAI `user` field or an `X-Session-Id` header: a conversation
    prompt_ids: tuple[int, ...] = ()  # the prompt's token ids (cache- and suffix-aware routing; may be empty)
    group: str | None = None  # a rollout batch (TailSieve): requests sampled from the same prompt set
    workload: str | None = None  # a label (bench workload name) a predictor may use
    features: tuple[float, ...] = ()  # drafter features a length predictor reads (OUTLETS)


@dataclass
class ReplicaView:
    """One replica as the router sees it between requests."""

    index: int
    alive: bool = True
    running: int = 0  # sequences in its engine
    queued: int = 0  # waiting for a slot
    max_running: int = 16
    kv_rows_used: int = 0  # K/V rows held by its running sequences (prompt + generated so far)
    kv_rows_total: int = 1  # rows its cache holds in all (ServeOptions.max_kv_rows)
    speculative: bool = True  # whether its engine drafts by default (TailSieve's low-latency set)
    sessions: frozenset[str] = frozenset()  # sessions whose history it holds (K/V prefix, suffix index)
    recent_tau: float | None = None  # mean tokens per round of its last requests (None: none yet)

    @property
    def load(self) -> int:
        return self.running + self.queued

    @property
    def kv_free(self) -> int:
        return self.kv_rows_total - self.kv_rows_used


@dataclass(frozen=True)
class Decision:
    replica: int  # ReplicaView.index
    speculate: bool | None = None  # None: the replica's default; False: plain decoding for this request
    priority: float = 0.0  # the replica admits lower first (FCFS: the arrival time)
    reason: str = ""  # a short word for logs and metrics ("sticky", "least-load", "tail", ...)


@dataclass(frozen=True)
class Outcome:
    """A finished request, as the policy hears of it."""

    request: RequestInfo
    replica: int
    output_tokens: int
    finished: float  # on the same clock as RequestInfo.arrived
    speculated: bool = True
    tau: float | None = None
    error: str | None = None


class Policy(Protocol):
    name: str

    def route(self, request: RequestInfo, replicas: list[ReplicaView], now: float) -> Decision:
        """Choose a live replica for `request` (replicas: all of them, dead ones with alive=False)."""

    def priority(self, request: RequestInfo, now: float) -> float:
        """The request's place in its replica's queue now: lower first (aging may lower it over time)."""

    def observe(self, outcome: Outcome) -> None:
        """A request finished (or failed)."""


@dataclass
class PolicyBase:
    """Defaults: FCFS order and nothing learned. Policies subclass it and override `route`."""

    name: str = "base"
    options: dict = field(default_factory=dict)

    def route(self, request: RequestInfo, replicas: list[ReplicaView], now: float) -> Decision:
        raise NotImplementedError

    def priority(self, request: RequestInfo, now: float) -> float:
        return request.arrived

    def observe(self, outcome: Outcome) -> None:
        return None


def alive(replicas: list[ReplicaView]) -> list[ReplicaView]:
    """The live replicas; raises NoReplica when there are none."""
    live = [r for r in replicas if r.alive]
    if not live:
        raise NoReplica("no live replica (each has died or is restarting); if none comes back, restart "
                        "`outrider serve --replicas N`")
    return live


class NoReplica(RuntimeError):
    pass
