"""The engine in its own thread; the HTTP side only enqueues, cancels and reads.

The HTTP layer (asyncio) hands a `Job` to `EngineWorker.submit` and awaits the job's queue; the
engine thread adds waiting jobs between steps, runs `EngineLoop.step()`, and pushes each
choice's newly stable text (the engine's text stream applies the stop strings) and finally its
Completion onto that queue with `loop.call_soon_threadsafe`. Nothing on the HTTP side ever waits
for a step, and the engine never waits for a client: a client that goes away is cancelled and
its slot is freed at the next step.

A job holds one engine Request per choice (n samples of one prompt, or several prompts); the
samples of one prompt share its prefill (`Request.prefill_from`: the first sample's id).

Failures: a request the engine fails alone (finish_reason "error": its drafter or verifier
raised, or its logits were NaN) ends as a Completion like any other, and the HTTP side answers
it with a 500. An exception out of `EngineLoop.step()` is fatal by the engine's contract: every
request in flight gets a 500, new ones a 503, and `on_fatal` is called (`outrider serve` then
exits non-zero, so a supervisor restarts it). `abort` (a second Ctrl-C) answers everything in
flight with a 503 and stops the thread after the step it is in.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
import traceback
from typing import Callable

from ..engine.loop import EngineLoop
from ..engine.request import Request
from ..errors import ConfigError
from .metrics import Metrics
from .errors import ApiError


@dataclasses.dataclass
class Update:
    """What one step did for choice `index`: its committed tokens' count, its new stable text
    and their logprobs (None when the engine sends none with events)."""

    index: int
    tokens: int
    text: str
    logprobs: list | None = None


class Job:
    """One HTTP request in flight. `queue` yields ("update", Update) items, ("done", (index,
    engine Completion)) once per choice, or ("error", ApiError) once, which ends the job."""

    def __init__(self, requests: list[Request], loop: asyncio.AbstractEventLoop,
                 prefill_from: list[int | None] | None = None):
        self.requests = requests
        self.prefill_from = prefill_from or [None] * len(requests)  # the choice whose prefill it shares
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.arrived = time.perf_counter()
        self.ids: list[int | None] = [None] * len(requests)  # engine request ids
        self.first_token_at: list[float | None] = [None] * len(requests)
        self.last_token_at: list[float | None] = [None] * len(requests)
        self.session: str | None = None  # a conversation (X-Session-Id or `user`): cluster routing reads it
        self.headers = {}  # the HTTP request's headers (X-Rollout-Group, X-Workload: cluster/info.py)
        self.stream = True  # False: the client sees nothing before the end (a replica's death is then retried)

    def push(self, kind: str, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, item))
        except RuntimeError:  # the server's event loop has closed: nobody is waiting any more
            pass


class EngineWorker:
    def __init__(self, engine: EngineLoop, metrics: Metrics, max_queue: int,
                 on_fatal: Callable[[str], None] | None = None):
        self.engine = engine
        self.metrics = metrics
        self.max_queue = max_queue
        self.on_fatal = on_fatal
        self.draining = False
        self.failed: str | None = None
        self._cv = threading.Condition()
        self._inbox: list[Job] = []
        self._cancels: list[Job] = []
        self._jobs: dict[int, tuple[Job, int]] = {}  # engine request id -> (job, choice index)
        self._waiting = 0  # engine.num_waiting after the last step
        self._busy = False  # engine.has_work after the last step
        self._stopped = False
        self.thread = threading.Thread(target=self._run, name="outrider-engine", daemon=True)

    # HTTP side -------------------------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def submit(self, job: Job) -> None:
        """Queue a checked job; 503 while draining or broken, 429 when the queue is full."""
        with self._cv:
            if self.failed:
                raise ApiError(503, f"the engine stopped after an internal error ({self.failed}); the server is "
                                    "restarting: retry in a moment", kind="server_error", code="engine_failed")
            if self.draining or self._stopped:
                raise ApiError(503, "the server is shutting down: retry on another replica", kind="server_error",
                               code="shutting_down")
            queued = sum(len(j.requests) for j in self._inbox) + self._waiting
            if queued + len(job.requests) > self.max_queue:
                raise ApiError(429, f"the queue is full ({self.max_queue} requests waiting): retry later",
                               kind="rate_limit_error", headers={"Retry-After": "1"})
            self._inbox.append(job)
            self._cv.notify_all()

    def cancel(self, job: Job) -> None:
        with self._cv:
            self._cancels.append(job)
            self._cv.notify_all()

    def drain(self) -> None:
        """Refuse new requests from now on; running and queued ones finish."""
        with self._cv:
            self.draining = True

    def wait_idle(self, timeout: float | None = None) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: (not self._inbox and not self._busy) or self._stopped, timeout)

    def abort(self, message: str) -> None:
        """Answer every job in flight with a 503 now and stop the engine thread after its step."""
        with self._cv:
            self._stopped = True
            jobs = {id(j): j for j, _ in self._jobs.values()} | {id(j): j for j in self._inbox}
            self._inbox, self._jobs = [], {}
            self._cv.notify_all()
        for job in jobs.values():
            job.push("error", ApiError(503, message, kind="server_error", code="shutting_down"))

    def stop(self, timeout: float = 10) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread.join(timeout=timeout)

    def health(self) -> dict:
        """What /health adds to its status: the prefix cache where it is on, its blocks and counters
        (where it is off, the startup line says why); paged K/V's pool."""
        e = self.engine
        pool = {}
        if getattr(e, "paged", False):  # paged K/V (--kv-memory): the pool and how much of it is held
            pool = {"kv_pages": {"pages": e.cache.num_pages, "page_rows": e.cache.page_size, "used": e.cache.pages_used,
                                 "memory_mb": round(e.cache.nbytes() / (1 << 20), 3), "preemptions": e.preemptions}}
        cache, note = e.prefix_cache, e.prefix_cache_note
        if cache is None:
            return pool
        info = {"enabled": True, "block_tokens": cache.block, "budget_mb": cache.budget_bytes / (1 << 20),
                "blocks": cache.blocks, "usage": round(cache.usage(), 6), "queries": cache.queries,
                "hits": cache.hits}
        return pool | {"prefix_cache": info | ({"reason": note} if note else {})}

    @property
    def queued(self) -> int:
        with self._cv:
            return sum(len(j.requests) for j in self._inbox) + self._waiting

    @property
    def in_flight(self) -> int:
        """Requests running or queued."""
        return self.engine.num_running + self.queued

    # engine thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._inbox or self._cancels or self._busy or self._stopped)
                if self._stopped:
                    return
                inbox, self._inbox = self._inbox, []
                cancels, self._cancels = self._cancels, []
            try:
                with self._cv:  # _jobs changes only under the lock (abort empties it from another thread)
                    for job in inbox:
                        self._add(job)
                    for job in cancels:
                        for rid in job.ids:
                            if rid is not None:
                                self.engine.cancel(rid)
                events = self.engine.step()
                with self._cv:
                    if self._stopped:  # aborted during the step: everyone has been answered
                        return
                    for event in events:
                        self._event(event)
            except Exception as err:  # fatal by the engine's contract: it isolates per-request faults
                traceback.print_exc()
                self._fail_all(f"{type(err).__name__}: {err}")
                return
            e = self.engine
            self.metrics.engine_state(e.num_running, e.num_waiting, e.kv_rows_used, e.kv_rows_reserved,
                                      e.kv_rows_total)
            if e.prefix_cache is not None:
                self.metrics.prefix_cache_state(e.prefix_cache)
            with self._cv:
                self._waiting = e.num_waiting
                self._busy = e.has_work
                self._cv.notify_all()

    def _add(self, job: Job) -> None:
        """Add a job's requests; the samples of one prompt name the first one's prefill."""
        for i, request in enumerate(job.requests):
            source = job.prefill_from[i]
            if source is not None:
                request = dataclasses.replace(request, prefill_from=job.ids[source])
            try:
                rid = self.engine.add(request)
            except Exception as err:  # checked on the HTTP side, so a bug: this job fails alone
                for added in job.ids[:i]:
                    self.engine.cancel(added)
                    self._jobs.pop(added, None)
                if isinstance(err, (ConfigError, TypeError)):
                    job.push("error", ApiError(400, str(err)))
                else:
                    traceback.print_exc()
                    job.push("error", ApiError(500, f"internal error adding the request: {type(err).__name__}: "
                                                    f"{err}", kind="server_error", code="internal_error"))
                return
            job.ids[i] = rid
            self._jobs[rid] = (job, i)

    def _event(self, event) -> None:
        entry = self._jobs.get(event.request_id)
        if entry is None:  # a job whose other choice failed to add, already answered
            return
        job, i = entry
        now = time.perf_counter()
        if event.new_tokens:
            self._observe_tokens(job, i, len(event.new_tokens), now)
        logprobs = getattr(event, "logprobs", None)
        if event.text or event.new_tokens:
            job.push("update", Update(i, len(event.new_tokens), event.text, logprobs))
        if event.completion is None:
            return
        self._jobs.pop(event.request_id, None)
        job.push("done", (i, event.completion))
        first = job.first_token_at[i]
        self.metrics.request_ended(event.completion, len(job.requests[i].prompt_ids),
                                   None if first is None else first - job.arrived, now - job.arrived)

    def _observe_tokens(self, job: Job, i: int, count: int, now: float) -> None:
        """Time per output token: one observation per token after the first. A round commits
        several tokens at once; each gets an equal share of the time since the last round (the
        first round's extra tokens came with the first, at no extra time)."""
        last = job.last_token_at[i]
        if last is None:
            job.first_token_at[i] = now
            gaps = [0.0] * (count - 1)
        else:
            gaps = [(now - last) / count] * count
        job.last_token_at[i] = now
        self.metrics.output_tokens(gaps)

    def _fail_all(self, message: str) -> None:
        with self._cv:
            self.failed = message
            jobs = {id(j): j for j, _ in self._jobs.values()} | {id(j): j for j in self._inbox}
            self._inbox, self._jobs, self._busy = [], {}, False
            self._cv.notify_all()
        for job in jobs.values():
            job.push("error", ApiError(500, f"internal error in the engine: {message}; the server is restarting",
                                       kind="server_error", code="engine_failed"))
        if self.on_fatal is not None:
            self.on_fatal(message)
