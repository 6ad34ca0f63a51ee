"""The discrete-event simulator: a workload against N simulated replicas through one policy.

    result = simulate(workload, policy, costs, replicas=8)
    result.jobs        # every request: arrived, admitted, first token, finished, replica, ...
    summarize(result)  # report.py: throughput, latency percentiles, makespan

Three kinds of event, in time order (ties: the order they were scheduled):

    arrive(job)     the policy routes it (`Policy.route` on the replicas' views); it joins that
                    replica's queue with the Decision's speculation; an idle replica is started
    start(r)        an idle replica admits and starts a step (after every arrival of that instant)
    step_end(r)     replica r's step is over: its round's tokens are committed, ended requests
                    are reported to the policy (`observe`) and, closed loop, the client sends its
                    next request; then r admits (in `Policy.priority` order) and starts its next
                    step, if it has work

A policy with a `moves(running, replicas, now)` method (TailSieve) is asked after every step end
which running requests to move: a moved request leaves its replica (its rows freed) and joins the
other's queue with its prompt and its output so far to prefill again. `Policy` declares no such
method: it is optional (the Ray router applies it too: cluster/moves.py).

Nothing here is random: a workload and a policy give one result.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field, replace

from ...errors import ConfigError
from ..policy import Decision, Outcome, alive
from .costs import CostModel
from .replica import Job, SimReplica
from .workload import Workload


@dataclass
class SimResult:
    workload: str
    policy: str
    replicas: int
    jobs: list[Job]
    replica_busy_s: list[float] = field(default_factory=list)
    replica_seq_s: list[float] = field(default_factory=list)
    end: float = 0.0
    decisions: dict = field(default_factory=dict)  # Decision.reason -> count


def _replicas(workload: Workload, costs: CostModel, n: int) -> list[SimReplica]:
    spec = workload.replica
    out = []
    for i in range(n):
        low = i < spec.low_latency
        out.append(SimReplica(i, spec, costs, spec.low_latency_max_running if low else spec.max_running,
                              True if low else spec.speculative))
    return out


class Simulator:
    def __init__(self, workload: Workload, policy, costs: CostModel, replicas: int):
        if replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {replicas}")
        self.workload, self.policy, self.costs = workload, policy, costs
        self.replicas = _replicas(workload, costs, replicas)
        self.views = [r.view for r in self.replicas]
        self.events: list = []
        self.seq = 0
        self.now = 0.0
        self.jobs: list[Job] = []
        self.pending = list(workload.requests)  # closed loop: not yet sent
        self.decisions: dict[str, int] = {}
        self._moves = getattr(policy, "moves", None)
        self._rounds: dict[int, list[Job]] = {}
        self._groups: dict[str, dict[Job, None]] = {}  # a group's unfinished requests, in arrival order (`moves`)

    def _push(self, when: float, kind: str, payload) -> None:
        heapq.heappush(self.events, (when, self.seq, kind, payload))
        self.seq += 1

    def run(self) -> SimResult:
        if self.workload.clients is None:
            for req in self.pending:
                self._push(req.info.arrived, "arrive", req)
            self.pending = []
        else:
            first, self.pending = self.pending[: self.workload.clients], self.pending[self.workload.clients:]
            for req in first:
                self._push(0.0, "arrive", req)
        while self.events:
            self.now, _, kind, payload = heapq.heappop(self.events)
            if kind == "arrive":
                self._arrive(payload)
            elif kind == "start":
                self._start(self.replicas[payload])
            else:
                self._step_end(payload)
        return SimResult(self.workload.name, getattr(self.policy, "name", type(self.policy).__name__),
                         len(self.replicas), self.jobs, [r.busy_s for r in self.replicas],
                         [r.seq_s for r in self.replicas], self.now, self.decisions)

    def _arrive(self, req) -> None:
        info = replace(req.info, arrived=self.now) if self.workload.clients is not None else req.info
        req = replace(req, info=info)
        decision = self.policy.route(info, self.views, self.now)
        job = Job(req, self.now, priority=decision.priority)
        self.jobs.append(job)
        if info.group is not None:
            self._groups.setdefault(info.group, {})[job] = None
        self._place(job, decision)

    def _place(self, job: Job, decision: Decision) -> None:
        replica = self.replicas[decision.replica]
        self.decisions[decision.reason or "-"] = self.decisions.get(decision.reason or "-", 0) + 1
        spec = replica.speculative if decision.speculate is None else decision.speculate
        job.speculate = spec if job.req.speculate is None else job.req.speculate
        job.prefill_total = max(job.req.info.prompt_tokens - 1, 0) + int(job.done)
        replica.enqueue(job)
        if not replica.busy:  # it starts a step once every arrival of this instant is in its queue
            replica.busy = True
            self._push(self.now, "start", replica.index)

    def _order(self, job: Job):
        return (self.policy.priority(job.req.info, self.now), job.arrived)

    def _start(self, replica: SimReplica) -> None:
        replica.admit(self._order, self.now)
        if not replica.running:
            if replica.queue:  # nothing runs and the head still does not fit: it never will
                head = replica.queue[0]
                raise ConfigError(f"request {head.id} reserves {replica.rows_for(head)} K/V rows but replica "
                                  f"{replica.index} holds {replica.spec.kv_rows_total}: raise kv_rows_total")
            replica.busy = False
            replica.refresh()
            return
        seconds, decoding = replica.plan_step()
        replica.busy = True
        replica.refresh()
        self._rounds[replica.index] = decoding
        self._push(self.now + seconds, "step_end", replica.index)

    def _step_end(self, index: int) -> None:
        replica = self.replicas[index]
        ended = replica.finish_round(self._rounds.pop(index), self.now)
        for job in ended:
            self.policy.observe(Outcome(job.req.info, index, job.req.output_tokens, self.now, job.speculate,
                                        job.req.output_tokens / max(job.rounds, 1)))
            if self.pending:
                self._push(self.now, "arrive", self.pending.pop(0))
            if job.req.info.group is not None:
                self._groups[job.req.info.group].pop(job, None)
        if self._moves is not None and ended:  # in a fixed order: set order varies between processes
            self._apply_moves(list(dict.fromkeys(j.req.info.group for j in ended if j.req.info.group is not None)))
        self._start(replica)

    def _apply_moves(self, groups: list) -> None:
        """Ask the policy about the unfinished requests of the groups a request just left."""
        jobs = [j for g in groups for j in self._groups.get(g, ())]
        if not jobs:
            return
        by_id = {j.id: j for j in jobs}
        running = [(j.req.info, j.replica, j.done) for j in jobs]
        for request_id, decision in self._moves(running, alive(self.views), self.now):
            job = by_id.get(request_id)
            if job is None or job.finished is not None or decision.replica == job.replica:
                continue
            self.replicas[job.replica].remove(job)
            job.moves += 1
            self._place(job, decision)


def simulate(workload: Workload, policy, costs: CostModel, replicas: int = 1) -> SimResult:
    return Simulator(workload, policy, costs, replicas).run()
