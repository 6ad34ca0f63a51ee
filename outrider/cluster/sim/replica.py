"""One simulated replica: the engine loop's continuous batching, with measured step costs.

It keeps what `EngineLoop.step` does, at the level of a step's cost:

1. admit waiting requests in the policy's order (`priority`, lower first; FCFS by default) while
   a slot is free and the rows a request reserves (prompt + max_tokens + a round's tree, plus a
   draft model's cache when it speculates) fit under `kv_rows_total`; the head of the queue is
   never jumped (engine/scheduler.py);
2. prefill up to `chunk_size` prompt tokens of the admitted requests, oldest first; a request
   whose prompt is in at the end of the step takes part in that step's round;
3. one round for every decoding request: the batch's cost is the profile's step(B, W), W the
   widest tree in it (a batched verify pads every tree to the widest, models/batch.py); each
   request commits `tau` tokens a round when it speculates (its own acceptance, fractional
   tokens carried over), one otherwise, and ends when it has its output tokens.

A step's effects land at its end; requests that arrive during it wait for the next, as requests
added between `step()` calls do. The view a policy gets counts in `kv_rows_used` the rows the
running requests reserved (what admission checks against), not the rows written so far.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..policy import ReplicaView
from .costs import CostModel
from .workload import ReplicaSpec, SimRequest


@dataclass(eq=False)  # one object a request: compared and hashed by identity
class Job:
    """A request's life in the simulation (times on the simulator's clock, seconds)."""

    req: SimRequest
    arrived: float
    speculate: bool = True
    priority: float = 0.0
    replica: int = -1
    rows: int = 0  # K/V rows reserved while running
    prefill_total: int = 0  # prompt tokens to prefill (a moved request: its output so far too)
    prefilled: int = 0
    done: float = 0.0  # output tokens committed (fractional: tau a round)
    rounds: int = 0
    admitted: float | None = None
    first_token: float | None = None
    finished: float | None = None
    moves: int = 0
    tau_used: float = 1.0

    @property
    def id(self) -> str:
        return self.req.info.id


@dataclass
class SimReplica:
    index: int
    spec: ReplicaSpec
    costs: CostModel
    max_running: int
    speculative: bool
    queue: list[Job] = field(default_factory=list)
    running: list[Job] = field(default_factory=list)
    reserved: int = 0
    busy: bool = False
    sessions: set = field(default_factory=set)
    taus: deque = field(default_factory=lambda: deque(maxlen=32))
    busy_s: float = 0.0  # time spent in steps
    seq_s: float = 0.0  # running sequences x seconds, summed over steps
    view: ReplicaView = field(init=False)

    def __post_init__(self) -> None:
        self.view = ReplicaView(self.index, max_running=self.max_running, kv_rows_total=self.spec.kv_rows_total,
                                speculative=self.speculative)

    def rows_for(self, job: Job) -> int:
        """Rows `job` reserves here: prompt + max_tokens + a tree (+ a draft model's cache if it speculates)."""
        rows = job.req.info.prompt_tokens + job.req.info.max_tokens
        if job.speculate:
            return int(rows * (1 + self.spec.draft_kv)) + self.spec.tree_rows
        return rows + 1

    def enqueue(self, job: Job) -> None:
        job.replica = self.index
        job.prefilled = 0
        self.queue.append(job)
        self.refresh()

    def remove(self, job: Job) -> None:
        if job in self.running:
            self.running.remove(job)
            self.reserved -= job.rows
        else:
            self.queue.remove(job)
        self.refresh()

    def refresh(self) -> None:
        v = self.view
        v.running, v.queued, v.kv_rows_used = len(self.running), len(self.queue), self.reserved
        v.recent_tau = sum(self.taus) / len(self.taus) if self.taus else None

    def admit(self, order, now: float) -> None:
        """Admit from the queue in `order(job)` order (lower first) while slots and rows allow."""
        if not self.queue:
            return
        self.queue.sort(key=order)
        while self.queue and len(self.running) < self.max_running:
            job = self.queue[0]
            rows = self.rows_for(job)
            if self.reserved + rows > self.spec.kv_rows_total:
                break  # the head waits; nothing behind it jumps ahead
            self.queue.pop(0)
            job.rows, job.admitted = rows, now if job.admitted is None else job.admitted
            self.reserved += rows
            self.running.append(job)

    def plan_step(self) -> tuple[float, list[Job]]:
        """Prefill this step's chunk; returns (the step's seconds, the requests in its round)."""
        budget, prefilled = self.spec.chunk_size, 0
        for job in self.running:
            need = job.prefill_total - job.prefilled
            if need > 0 and budget > 0:
                take = min(need, budget)
                job.prefilled += take
                budget -= take
                prefilled += take
        decoding = [j for j in self.running if j.prefilled >= j.prefill_total]
        width = max((j.req.width if j.speculate else 1.0 for j in decoding), default=0.0)
        seconds = self.costs.prefill(prefilled) + self.costs.step(len(decoding), width)
        self.busy_s += seconds
        self.seq_s += seconds * len(self.running)
        return seconds, decoding

    def finish_round(self, decoding: list[Job], now: float) -> list[Job]:
        """Commit the round's tokens; returns the requests that ended (their rows freed)."""
        ended = []
        for job in decoding:
            if job not in self.running:  # moved away during the step
                continue
            job.rounds += 1
            if job.first_token is None:
                job.first_token = now
            job.done += self.tau_for(job) if job.speculate else 1.0
            if job.done >= job.req.output_tokens:
                job.done, job.finished = float(job.req.output_tokens), now
                self.running.remove(job)
                self.reserved -= job.rows
                ended.append(job)
                if job.speculate:
                    self.taus.append(job.req.output_tokens / max(job.rounds, 1))
                if job.req.info.session is not None:
                    self.sessions.add(job.req.info.session)
                    self.view.sessions = frozenset(self.sessions)
        self.refresh()
        return ended

    def tau_for(self, job: Job) -> float:
        """The job's tokens a round here: its session-hit acceptance where this replica holds its history."""
        session = job.req.info.session
        hit = job.req.tau_hit is not None and session is not None and session in self.sessions
        job.tau_used = job.req.tau_hit if hit else job.req.tau
        return job.tau_used
