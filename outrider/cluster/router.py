"""The router: the HTTP front end's worker when the engines are replicas (Ray actors, replica.py).

serve/api.py checks a request, makes its `Job` and hands it to `state.worker.submit`; here that
worker is a `Router`, with EngineWorker's interface (submit, cancel, drain, wait_idle, abort,
stop, failed, draining, queued, engine.max_len / engine.check), so the OpenAI API is the same
code for one engine and for N. For each job the router

1. asks the policy (policy.py; `--policy`) for a `Decision`, given a `ReplicaView` of every
   replica: its running and queued sequences (the router's own count: sent and not seen to
   finish, and held for it), its K/V rows (polled), the sessions it has served, its recent tau;
   the request's `RequestInfo` carries its session, rollout group and workload (info.py);
2. sends the job to that replica (`Replica.run`, a Ray streaming generator) when one of its
   engine's slots is free, else holds it in that replica's queue here, where the policy's
   `priority` orders it (queues.py); `Decision.speculate` goes into each engine Request's
   `speculate` (a client's `speculate: false` stands);
3. passes what the replica streams back onto the job's queue, as the single server's worker does
   (a non-streaming job's choices are held until all have ended: its client sees nothing before
   the end, so it can still be retried);
4. tells the policy how it went (`observe(Outcome)`), and, for a policy with `moves` (TailSieve),
   asks which of the request's rollout group to move elsewhere.

A job can move while it runs or waits (`move`, moves.py: cancelled where it runs, continued
from its committed tokens on the target, its client's stream unbroken). A replica that dies
(its actor gone: ActorDiedError/RayActorError, or its engine failed: code engine_failed) is
marked dead, logged, counted once and restarted while its slot has restarts left (life.py). Each
of its jobs in flight is sent once more, to a live replica the policy picks, if its client has
seen no output yet; otherwise it fails with a 503 (code replica_died) naming the replica. No job
is dropped without an answer. When no replica is left or coming back, `failed` is set (/health
503) and `on_fatal` is called, as the single server does when its engine fails.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
import threading
import time
from collections import OrderedDict

from ..serve.errors import ApiError
from .info import request_info, with_features
from .life import ReplicaLife
from .moves import Moves
from .policy import Decision, NoReplica, Outcome, ReplicaView, RequestInfo
from .queues import ReplicaQueues
from .replica import MAX_SESSIONS, Limits, api_error

POLL_S = 1.0  # how often the replicas' K/V rows are read (and idle replicas checked for life)
TAU_WEIGHT = 0.2  # ReplicaView.recent_tau: an exponential mean over finished requests
START_S = 300.0  # seconds a restarted replica may take to load its model


class ReplicaDied(Exception):
    pass


@dataclasses.dataclass(eq=False)  # hashed by identity: a key of the replicas' queues
class Flight:
    """A job between submit and its last answer."""

    job: object  # serve.worker.Job
    info: RequestInfo
    key: str
    replica: int | None = None
    tried: list[int] = dataclasses.field(default_factory=list)
    forwarded: bool = False  # its client has been sent something
    cancelled: bool = False
    held: list = dataclasses.field(default_factory=list)  # a non-streaming job's ended choices
    completions: list = dataclasses.field(default_factory=list)
    speculated: bool = True  # as last sent: the engine drafts and neither the client nor the policy said no
    turn: object = None  # an asyncio.Future while it waits for a slot: "go", "died", "cancelled" or "moved"
    move: object = None  # moves.Move, from its first move on
    asked: object = None  # a move's Decision asked for from another thread, until the event loop takes it
    leg_requests: list = dataclasses.field(default_factory=list)  # a moved job's requests on its replica now
    legs: int = 0  # runs started on replicas (a move starts another)
    run_key: str = ""  # the current run's key on its replica
    generation: int = 0  # the replica's generation the current run went to (life.py)
    running: bool = False  # its run's stream is open
    sent: dict = dataclasses.field(default_factory=dict)  # choice -> characters its client has had
    finished: set = dataclasses.field(default_factory=set)  # choices ended
    produced: int = 0  # output tokens its client has had


class Router(ReplicaLife, Moves):
    def __init__(self, replicas: list, limits: Limits, policy, metrics, max_queue: int, on_fatal=None,
                 on_stop=None, log=print, poll_s: float = POLL_S, decode=None, spawn=None, restarts: int = 0,
                 start_s: float = START_S):
        """replicas: Ray actor handles of `Replica`, by index; metrics: a ClusterMetrics;
        on_stop(): after `stop` (the backend shuts Ray down or kills its actors); decode(ids): the
        tokenizer's, for a moved request's text; spawn(index): a new actor for a dead replica's
        slot, at most `restarts` times a slot (life.py)."""
        self.replicas = replicas
        self.engine = limits  # api.py reads engine.max_len and engine.check(request)
        self.policy = policy
        self.metrics = metrics
        self.max_queue = max_queue
        self.on_fatal, self.on_stop, self.log, self.poll_s = on_fatal, on_stop, log, poll_s
        self.decode, self.spawn, self.max_restarts, self.start_s = decode, spawn, restarts, start_s
        self.views = [ReplicaView(i, max_running=limits.max_running, kv_rows_total=limits.max_kv_rows,
                                  speculative=limits.speculative) for i in range(len(replicas))]
        self.queues = ReplicaQueues([limits.max_running] * len(replicas),
                                    lambda flight: self.policy.priority(flight.info, self._now()))
        self._sessions = [OrderedDict() for _ in replicas]  # sessions sent to each, the latest last
        self.generation = [0] * len(replicas)  # a slot's actor: 0 the first, +1 each restart
        self.restarts = [0] * len(replicas)  # restarts begun, by slot
        self.restarted = [0] * len(replicas)  # restarts done, by slot
        self._restarting: set[int] = set()
        self.draining = False
        self.failed: str | None = None
        self._stopped = False
        self._cv = threading.Condition()
        self._flights: dict[int, Flight] = {}  # id(job) -> its flight
        self._tasks: set = set()
        self._keys = itertools.count()
        self._clock0 = time.monotonic()
        self._poller = threading.Thread(target=self._poll, name="outrider-router-poll", daemon=True)

    # the worker interface (serve/worker.py) ------------------------------------------------------
    def start(self) -> None:
        self._poller.start()

    def submit(self, job) -> None:
        """Take a checked job (from the event loop's thread); 503 while draining or with no
        replica alive, 429 when the replicas' queues are full, 400 for a bad routing header."""
        with self._cv:
            if self.failed:
                raise ApiError(503, f"{self.failed}; the server is restarting: retry in a moment",
                               kind="server_error", code="engine_failed")
            if self.draining or self._stopped:
                raise ApiError(503, "the server is shutting down: retry on another replica", kind="server_error",
                               code="shutting_down")
            live = [v for v in self.views if v.alive]
            if not live:
                raise ApiError(503, f"no replica is alive ({len(self._restarting)} restarting): retry in a moment",
                               kind="server_error", code="no_replica", headers={"Retry-After": "5"})
            if sum(v.queued for v in live) + len(job.requests) > self.max_queue * len(live):
                raise ApiError(429, f"the queues are full ({self.max_queue} requests waiting a replica): retry "
                                    "later", kind="rate_limit_error", headers={"Retry-After": "1"})
            flight = Flight(job, request_info(job, self._now()), f"job-{next(self._keys)}")
            self._flights[id(job)] = flight
        task = job.loop.create_task(self._fly(flight))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def cancel(self, job) -> None:
        flight = self._flights.get(id(job))
        if flight is not None:
            self._cancel(flight)

    def _cancel(self, flight: Flight) -> None:
        flight.cancelled = True
        if flight.replica is None:  # not routed yet: it will not be
            return
        if flight.turn is not None and not flight.turn.done():  # still waiting for a slot
            self._release(flight)
            self._wake(flight, "cancelled")
            return
        try:
            self.replicas[flight.replica].cancel.remote(flight.run_key)
        except Exception:  # a dead replica has nothing left to cancel
            pass

    def drain(self) -> None:
        with self._cv:
            self.draining = True

    def wait_idle(self, timeout: float | None = None) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: not self._flights or self._stopped, timeout)

    def abort(self, message: str) -> None:
        """Answer every job in flight with a 503 now and cancel it on its replica."""
        with self._cv:
            self._stopped = True
            flights, self._flights = list(self._flights.values()), {}
            self._cv.notify_all()
        for flight in flights:
            self._cancel(flight)
            flight.job.push("error", ApiError(503, message, kind="server_error", code="shutting_down"))

    def stop(self, timeout: float = 10) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
            on_stop, self.on_stop = self.on_stop, None
        if on_stop is not None:
            on_stop()

    @property
    def queued(self) -> int:
        with self._cv:
            return sum(v.queued for v in self.views if v.alive)

    @property
    def in_flight(self) -> int:
        with self._cv:
            return sum(len(f.job.requests) for f in self._flights.values())

    # one job ---------------------------------------------------------------------------------------
    def _now(self) -> float:
        return time.monotonic() - self._clock0

    async def _fly(self, flight: Flight) -> None:
        """Route, run, move when asked, retry once after a death; the job always gets its answer."""
        error, target = None, None
        try:
            while not flight.cancelled:
                try:
                    decision = self._route(flight, target)
                except NoReplica as err:
                    message = str(err) if not flight.tried else (f"replica {flight.tried[-1]} died while running "
                                                                   "this request and no replica is left to retry it on")
                    error = self._fail(flight, ApiError(503, message, kind="server_error", code="no_replica"),
                                       "no_replica")
                    return
                try:
                    verdict = "go"
                    if flight.turn is not None:  # its replica is full: wait for a slot there
                        verdict = await flight.turn
                        if verdict == "cancelled":
                            return
                        if verdict == "died":
                            raise ReplicaDied("it died while this request waited for a slot")
                    if flight.cancelled:  # its client went away before it was sent
                        return
                    if flight.move is None or flight.move.target is None:  # no move asked for meanwhile
                        if await self._run(flight, decision) == "error":
                            return
                    if flight.move is None or flight.move.target is None or flight.cancelled:
                        return
                    target = self._next_leg(flight)
                    if target is None:
                        return
                except ReplicaDied as died:
                    self._died(decision.replica, str(died), flight.generation if verdict == "go" else None)
                    if flight.cancelled:
                        return
                    if flight.forwarded or len(flight.tried) > 1:
                        error = self._fail(flight, self._died_error(flight, decision.replica), "replica_died")
                        return
                    self.metrics.retried.inc()
                    self.log(f"outrider serve: retrying request {flight.key} (nothing streamed yet) on another "
                             "replica", file=sys.stderr)
                    target, flight.move, flight.held, flight.completions = None, None, [], []  # from the start
                    flight.finished, flight.sent = set(), {}
                finally:
                    self._release(flight)
        except Exception as err:  # a bug here must still answer the client
            error = self._fail(flight, ApiError(500, f"internal error in the router: {type(err).__name__}: {err}",
                                                kind="server_error", code="internal_error"), "internal_error")
        finally:
            with self._cv:
                self._flights.pop(id(flight.job), None)
                self._cv.notify_all()
            if flight.replica is not None:
                self._observe(flight, error)
                self._tail_moves(flight.info.group)

    def _route(self, flight: Flight, target: Decision | None = None):
        """Place the flight on a replica: the policy's choice, or a move's live target."""
        with self._cv:
            moved = target is not None and self.views[target.replica].alive
            decision = target if moved else self.policy.route(flight.info, self.views, self._now())
            view = self.views[decision.replica]
            if not view.alive:  # a policy's bug would otherwise send work into a dead actor
                raise NoReplica(f"the policy chose replica {decision.replica}, which is dead")
            width = len(flight.leg_requests) if flight.move is not None else len(flight.job.requests)
            now = self.queues.add(decision.replica, flight, width)
            flight.turn = None if now else flight.job.loop.create_future()
            self._count(decision.replica)
            if flight.info.session is not None:
                seen = self._sessions[decision.replica]
                seen[flight.info.session] = None
                seen.move_to_end(flight.info.session)
                while len(seen) > MAX_SESSIONS:
                    seen.popitem(last=False)
                view.sessions = frozenset(seen)
            flight.replica = decision.replica
            if not moved:
                flight.tried.append(decision.replica)
        counter = self.metrics.moved if moved else self.metrics.routed
        counter.labels(str(decision.replica), decision.reason or self.policy.name).inc()
        return decision

    def _release(self, flight: Flight) -> None:
        """The flight is done with its replica (finished, failed, cancelled, moved): its slots go to
        the waiting flights the policy puts first."""
        with self._cv:
            admitted = self.queues.remove(flight)
            self._count(flight.replica)
        for waiting in admitted:
            self._wake(waiting, "go")

    @staticmethod
    def _wake(flight: Flight, verdict: str) -> None:
        def wake():
            if not flight.turn.done():
                flight.turn.set_result(verdict)

        flight.job.loop.call_soon_threadsafe(wake)  # from the event loop's thread or the poller's

    def _count(self, replica: int) -> None:
        view, sent = self.views[replica], self.queues.running[replica]
        view.running = min(sent, view.max_running)
        view.queued = sent - view.running + self.queues.queued(replica)
        self.metrics.waiting.labels(str(replica)).set(self.queues.queued(replica))

    async def _run(self, flight: Flight, decision) -> str | None:
        """Run the flight's current leg on its replica; "error" when it ended with an error."""
        import ray

        job, move = flight.job, flight.move
        requests, prefill_from = job.requests, job.prefill_from
        if move is not None and move.continuing:  # prompt + committed output, on another replica
            requests, prefill_from = flight.leg_requests, [None] * len(flight.leg_requests)
        if decision.speculate is not None:  # the policy's word, but a client's `speculate: false` stands
            requests = [dataclasses.replace(r, speculate=r.speculate and decision.speculate) for r in requests]
        flight.speculated = self.engine.speculative and all(r.speculate for r in requests)
        grammars = [None if r.grammar is None else r.grammar.text for r in requests]
        requests = [dataclasses.replace(r, grammar=None) for r in requests]
        handle = self.replicas[decision.replica]
        flight.generation, flight.run_key = self.generation[decision.replica], f"{flight.key}.{flight.legs}"
        flight.legs += 1
        extra = {"ids": True} if move is not None and move.continuing and job.stream else {}
        try:
            stream = handle.run.options(num_returns="streaming").remote(
                flight.run_key, requests, prefill_from, grammars, job.session, job.stream, **extra)
            flight.running = True
            cancelled = False
            async for ref in stream:
                for kind, item in await ref:
                    if kind == "error":
                        err = api_error(item)
                        if err.code == "engine_failed":  # its engine stopped: the replica is gone
                            raise ReplicaDied(err.message)
                        self._forward(flight, kind, err)
                        return "error"
                    for out in ([(kind, item)] if flight.move is None else flight.move.translate(kind, item)):
                        self._forward(flight, *out)
                    if flight.move is not None and flight.move.cancel_leg and not cancelled:  # ended here
                        handle.cancel.remote(flight.run_key)
                        cancelled = True
        except ray.exceptions.RayActorError as err:
            raise ReplicaDied(str(err).splitlines()[0]) from None
        finally:
            flight.running = False

    def _forward(self, flight: Flight, kind: str, item) -> None:
        job = flight.job
        if kind == "ids":  # a continuing leg's token ids reach the client as text (moves.py)
            return
        if kind == "done":
            flight.completions.append(item[1])
            flight.finished.add(item[0])
        if job.stream or kind == "error":
            job.queue.put_nowait((kind, item))
            if kind == "update":
                flight.sent[item.index] = flight.sent.get(item.index, 0) + len(item.text)
                flight.produced += item.tokens
            flight.forwarded = flight.forwarded or kind != "update" or bool(item.tokens or item.text)
        elif kind == "done":  # the whole answer at once: nothing reaches the client before the end
            flight.held.append(item)
            if len(flight.held) == len(job.requests):
                for held in flight.held:
                    job.queue.put_nowait(("done", held))
                flight.forwarded = True

    def _fail(self, flight: Flight, err: ApiError, reason: str) -> str:
        self.metrics.failed.labels(reason).inc()
        flight.job.queue.put_nowait(("error", err))
        return err.message

    def _died_error(self, flight: Flight, dead: int) -> ApiError:
        if len(flight.tried) > 1:
            message = (f"replica {flight.tried[0]} died while running this request, and replica {dead}, where it "
                       "was retried once, died too: send it again")
        else:
            message = (f"replica {dead} died while running this request, after part of its output had been "
                       "streamed (a request whose client has output is not retried): send it again")
        return ApiError(503, message, kind="server_error", code="replica_died")

    def _observe(self, flight: Flight, error: str | None) -> None:
        taus = [c.stats.get("mean_accepted_length") for c in flight.completions]
        taus = [t for t in taus if t is not None]
        tau = sum(taus) / len(taus) if taus else None
        view = self.views[flight.replica]
        if tau is not None and error is None:
            view.recent_tau = tau if view.recent_tau is None else (1 - TAU_WEIGHT) * view.recent_tau + TAU_WEIGHT * tau
        info = with_features(flight.info, flight.completions, flight.speculated)
        self.policy.observe(Outcome(info, flight.replica, sum(len(c.token_ids) for c in flight.completions),
                                    self._now(), flight.speculated, tau, error))
