"""One replica: an engine and its worker thread (serve/worker.py) inside a Ray actor.

The actor builds exactly what `outrider serve` builds for its one engine (`serve.server.engine_worker`)
and runs jobs through the same `EngineWorker`, so a replica's outputs and metrics are the
single server's. The router (router.py) calls:

    limits()            what the front end checks requests against (rows per slot, K/V rows, ...)
    run(key, ...)       a streaming generator: lists of the worker's queue items for one job,
                        ("update", Update) (streams only), ("done", (index, Completion)) or ("error", dict);
                        with ids=True each update comes after ("ids", (index, token ids)), the tokens it
                        committed (a moved request's text is made by the router from them: moves.py)
    cancel(key)         the client went away, or the job moves: free its slots at the next step (each
                        unfinished choice ends "cancelled" with the tokens it committed); a key not
                        seen yet is remembered, and its run ends at once
    stats()             its ReplicaView fields: running, queued, K/V rows, sessions seen
    metrics_text()      its Prometheus exposition (serve/metrics.py)

Errors cross the process boundary as `ApiError.__dict__` (an exception with a custom constructor
does not unpickle), and a grammar as its text: the compiled form holds the tokenizer's llguidance
object, so the replica puts it back together with its own compiler.

`Replica` is a plain class; `remote_class()` wraps it with `ray.remote` on first use, so this
module imports without Ray.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import OrderedDict

from ..serve.errors import ApiError
from ..serve.server import ServeOptions, engine_worker
from ..engine.request import Completion
from ..serve.worker import EngineWorker, Job

MAX_SESSIONS = 4096  # sessions a replica remembers having seen (the oldest are forgotten)
MAX_EARLY = 1024  # cancelled keys remembered before their run came


class IdsWorker(EngineWorker):
    """The server's worker; a job with `want_ids` also gets the token ids each step committed for
    a choice, ("ids", (index, ids)), just before that step's update."""

    def _event(self, event) -> None:
        entry = self._jobs.get(event.request_id)
        if entry is not None and event.new_tokens and getattr(entry[0], "want_ids", False):
            entry[0].push("ids", (entry[1], list(event.new_tokens)))
        super()._event(event)


@dataclasses.dataclass
class Limits:
    """What every request is checked against before it is routed; the same on every replica
    (they are built from one ServeOptions). `check` applies the rule of `EngineLoop.check`."""

    model_name: str
    max_len: int  # K/V rows per slot
    max_kv_rows: int  # rows all running requests may reserve
    headroom: int  # rows a round's draft tree may add
    vocab: int
    max_running: int
    speculative: bool  # the engine drafts by default

    def check(self, request) -> int:
        from ..engine.request import check_request
        from ..errors import ConfigError

        check_request(request, self.max_len, vocab=self.vocab)
        rows = min(self.max_len, len(request.prompt_ids) + request.max_new_tokens + self.headroom)
        if rows > self.max_kv_rows:
            raise ConfigError(f"the request needs {rows} K/V rows but the engine holds {self.max_kv_rows}: "
                              "ask for fewer tokens or raise the K/V row limit")
        return rows


class Replica:
    """An engine in a Ray actor (async: `run` is called concurrently, one job each)."""

    def __init__(self, options: ServeOptions, index: int, runtime=None):
        from .. import config

        if runtime is not None:  # the front end's runtime config (--config, --threads) in this process
            config.use(runtime)
        self.index = index
        self.llm, worker, self.metrics, _ = engine_worker(options)
        self.worker = IdsWorker(worker.engine, worker.metrics, worker.max_queue)
        self.worker.start()
        self._jobs: dict[str, Job] = {}
        self._sessions: OrderedDict[str, None] = OrderedDict()
        self._early: OrderedDict[str, None] = OrderedDict()  # cancelled before their run came

    def limits(self) -> Limits:
        e = self.worker.engine
        return Limits(self.llm.name, e.max_len, e.scheduler.max_kv_rows, e.headroom,
                      self.llm.target.config.vocab_size, e.scheduler.num_slots, e.speculation is not None)

    async def run(self, key: str, requests: list, prefill_from: list, grammars: list, session: str | None,
                  stream: bool = True, ids: bool = False):
        """Run one job; yields lists of its queue items until every choice is done or it fails
        (without `stream`, no updates: its client sees only the end; with `ids`, the token ids)."""
        if key in self._early:  # cancelled before it came: nothing committed
            del self._early[key]
            yield [("done", (i, Completion("", [], "cancelled", logprobs=None if r.logprobs is None else [])))
                   for i, r in enumerate(requests)]
            return
        if grammars and any(grammars):
            from ..spec.grammar import Grammar

            compiler = self.llm.grammars()
            requests = [r if g is None else dataclasses.replace(r, grammar=Grammar(g, compiler))
                        for r, g in zip(requests, grammars)]
        if session is not None:
            self._sessions[session] = None
            self._sessions.move_to_end(session)
            while len(self._sessions) > MAX_SESSIONS:
                self._sessions.popitem(last=False)
        job = Job(requests, asyncio.get_running_loop(), prefill_from)
        job.want_ids = ids
        try:
            self.worker.submit(job)
        except ApiError as err:
            yield [("error", err.__dict__)]
            return
        self._jobs[key] = job
        done = 0
        try:
            while done < len(requests):
                items = [await job.queue.get()]
                while not job.queue.empty():  # what is ready goes in one message
                    items.append(job.queue.get_nowait())
                done += sum(kind == "done" for kind, _ in items)
                failed = any(kind == "error" for kind, _ in items)
                items = [(kind, item.__dict__ if kind == "error" else item) for kind, item in items
                         if stream or kind != "update"]
                if items:
                    yield items
                if failed:
                    return
        finally:
            self._jobs.pop(key, None)
            if done < len(requests):
                self.worker.cancel(job)

    def cancel(self, key: str) -> None:
        job = self._jobs.get(key)
        if job is not None:
            self.worker.cancel(job)
            return
        self._early[key] = None  # its run may not have come yet (or it has ended: then never used)
        while len(self._early) > MAX_EARLY:
            self._early.popitem(last=False)

    def stats(self) -> dict:
        e = self.worker.engine
        return {"running": e.num_running, "queued": self.worker.queued, "kv_rows_used": e.kv_rows_used,
                "kv_rows_total": e.scheduler.max_kv_rows, "sessions": len(self._sessions),
                "failed": self.worker.failed}

    def metrics_text(self) -> bytes:
        return self.metrics.exposition()

    def ready(self) -> str:
        """Where it runs, for the front end's log: "replica 0: pid 1234 on host"."""
        import os
        import socket

        return f"replica {self.index}: pid {os.getpid()} on {socket.gethostname()}"


def api_error(fields: dict) -> ApiError:
    """An ApiError sent by a replica as its fields."""
    err = ApiError(fields["status"], fields["message"])
    err.__dict__.update(fields)
    return err


_REMOTE = None


def remote_class(**options):
    """`Replica` as a Ray actor class (Ray imported here, on first use)."""
    global _REMOTE
    if _REMOTE is None:
        import ray

        _REMOTE = ray.remote(Replica)
    return _REMOTE.options(**options) if options else _REMOTE
