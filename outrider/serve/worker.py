"""The engine in its own thread; the HTTP side only enqueues, cancels and reads.

The HTTP layer (asyncio) hands a `Job` to `EngineWorker.submit` and awaits the job's queue; the
engine thread adds waiting jobs between steps, runs `EngineLoop.step()`, and pushes each job's
newly stable text (the engine's text stream applies the stop strings) and finally its
Completion onto that queue with `loop.call_soon_threadsafe`. Nothing on the HTTP side ever waits
for a step, and the engine never waits for a client: a client that goes away is cancelled and
its slot is freed at the next step.
"""

from __future__ import annotations

import asyncio
import threading
import time
import traceback

from ..engine.loop import EngineLoop
from ..engine.request import Request
from ..errors import ConfigError
from .metrics import Metrics
from .protocol import ApiError


class Job:
    """One request in flight, as the HTTP side waits on it. `queue` yields ("text", str) items,
    then ("done", engine Completion) or ("error", ApiError)."""

    def __init__(self, request: Request, loop: asyncio.AbstractEventLoop):
        self.request = request
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.arrived = time.perf_counter()
        self.first_token_at: float | None = None
        self.request_id: int | None = None

    def push(self, kind: str, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, item))


class EngineWorker:
    def __init__(self, engine: EngineLoop, metrics: Metrics, max_queue: int):
        self.engine = engine
        self.metrics = metrics
        self.max_queue = max_queue
        self.draining = False
        self.failed: str | None = None
        self._cv = threading.Condition()
        self._inbox: list[Job] = []
        self._cancels: list[Job] = []
        self._jobs: dict[int, Job] = {}
        self._waiting = 0  # engine.num_waiting after the last step
        self._busy = False  # engine.has_work after the last step
        self._stopped = False
        self.thread = threading.Thread(target=self._run, name="outrider-engine", daemon=True)

    # HTTP side -------------------------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def submit(self, job: Job) -> None:
        """Queue a checked request; 503 while draining or broken, 429 when the queue is full."""
        with self._cv:
            if self.failed:
                raise ApiError(503, f"the engine stopped after an internal error: {self.failed}", kind="server_error")
            if self.draining:
                raise ApiError(503, "the server is shutting down: retry on another replica", kind="server_error")
            if len(self._inbox) + self._waiting >= self.max_queue:
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
            return self._cv.wait_for(lambda: not self._inbox and not self._busy, timeout)

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        self.thread.join(timeout=10)

    @property
    def queued(self) -> int:
        with self._cv:
            return len(self._inbox) + self._waiting

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
                self._add(inbox)
                for job in cancels:
                    if job.request_id is not None:
                        self.engine.cancel(job.request_id)
                events = self.engine.step()
                for event in events:
                    self._event(event)
            except Exception as err:  # a bug: fail every request in flight, refuse new ones
                traceback.print_exc()
                self._fail_all(f"{type(err).__name__}: {err}")
                return
            e = self.engine
            self.metrics.engine_state(e.num_running, e.num_waiting, e.kv_rows_used, e.scheduler.rows_reserved,
                                      e.scheduler.num_slots * e.max_len)
            with self._cv:
                self._waiting = e.num_waiting
                self._busy = e.has_work
                self._cv.notify_all()

    def _add(self, inbox: list[Job]) -> None:
        for job in inbox:
            try:
                job.request_id = self.engine.add(job.request)
            except (ConfigError, TypeError) as err:
                job.push("error", ApiError(400, str(err)))
                continue
            self._jobs[job.request_id] = job

    def _event(self, event) -> None:
        job = self._jobs[event.request_id]
        now = time.perf_counter()
        if event.new_tokens and job.first_token_at is None:
            job.first_token_at = now
        if event.text:
            job.push("text", event.text)
        if event.completion is None:
            return
        del self._jobs[event.request_id]
        job.push("done", event.completion)
        ttft = None if job.first_token_at is None else job.first_token_at - job.arrived
        self.metrics.request_ended(event.completion, len(job.request.prompt_ids), ttft, now - job.arrived)

    def _fail_all(self, message: str) -> None:
        with self._cv:
            self.failed = message
            jobs = list(self._jobs.values()) + self._inbox
            self._inbox, self._jobs, self._busy = [], {}, False
            self._cv.notify_all()
        for job in jobs:
            job.push("error", ApiError(500, f"internal error in the engine: {message}", kind="server_error"))
