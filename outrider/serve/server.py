"""`outrider serve`: load the model, start the engine thread, run uvicorn; drain on SIGINT/SIGTERM.

Draining: the first SIGINT or SIGTERM makes new requests get 503 (and /health 503) while the
running and queued ones finish; then the server stops and the process exits 0. A second SIGINT
stops within a round: every request still in flight gets an OpenAI-shaped 503 (a stream, an
error event), and the process exits 0. An error the engine cannot recover from (one out of
`EngineLoop.step()`) answers every request in flight with a 500 and exits 1, so a supervisor
restarts the server rather than keep a live process that refuses everything.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import sys
import threading
from dataclasses import dataclass

from ..config import summary_line
from ..errors import ConfigError
from .fields import MAX_BODY_MB

EXTRA = "pip install 'outrider[serve]'"
DEFAULT_MAX_MODEL_LEN = 2048


@dataclass
class ServeOptions:
    model: str | None = None
    drafter: str | None = None
    tree: str = "chain"
    controller: str = "cost"
    max_tree_nodes: int = 256
    verifier: str | None = None  # a verifier by name, as generate's --verifier (None: the best exact one)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_running: int = 16
    max_queue: int = 256
    max_model_len: int | None = None  # None: min(DEFAULT_MAX_MODEL_LEN, the model's context)
    max_kv_rows: int | None = None
    chunk_size: int = 512
    prefix_cache: bool = True  # the exact prefix cache (engine/prefix_cache.py); off: every prompt prefilled whole
    prefix_cache_mb: int = 512
    prefix_cache_block: int = 16
    kv_memory: str | None = None  # paged K/V: MiB ("512") or pages ("2000p"); None: a slot of max_model_len rows each
    kv_page: int = 16  # rows a K/V page
    max_body_mb: int = MAX_BODY_MB  # a larger request body gets a 413
    device: str | None = None
    dtype: str | None = None
    threads: int | None = None
    kv_dtype: str | None = None
    # scale-out on Ray (outrider/cluster/backend.py): None runs this process's one engine
    replicas: int | None = None
    address: str | None = None  # an existing Ray cluster ("auto", "ray://HOST:PORT"); None: a local one
    policy: str = "least-load"
    replica_restarts: int = 2  # new actors a dead replica's slot may get (0: none)
    # the target's layers on N pipeline stages, Ray actors (cluster/pipeline*.py); None: in this process
    pipeline_stages: int | None = None
    pipeline_hop_ms: float = 0.0  # a simulated delay each time rows cross from one stage's machine to the next
    pipeline_rewind: str = "trim"  # "mask": rejected rows stay in the stages' K/V, masked (cluster/pipeline_rewind.py)
    pipeline_micro_batches: int = 1  # groups of sequences a batch goes down the pipeline in

    def check(self) -> "ServeOptions":
        """Refuse bad values by their flag's name, before anything loads."""
        for key in ("max_running", "max_queue", "max_model_len", "chunk_size", "max_kv_rows", "replicas",
                    "max_body_mb", "prefix_cache_mb", "prefix_cache_block", "kv_page"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"--{key.replace('_', '-')} must be a positive integer, got {value}")
        restarts = self.replica_restarts
        if isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < 0:
            raise ConfigError(f"--replica-restarts must be an integer >= 0 (0: never restart), got {restarts}")
        if not (isinstance(self.port, int) and 0 <= self.port <= 65535):
            raise ConfigError(f"--port must be in 0..65535, got {self.port}")
        if self.replicas is None and self.address is None and self.policy != "least-load":
            raise ConfigError(f"--policy {self.policy} routes between replicas: give --replicas N too")
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("--api-key is empty: give a key or leave the option out")
        from ..weights.loader import parse_kv_dtype

        parse_kv_dtype(self.kv_dtype)
        if self.pipeline_stages is not None:
            self._check_pipeline()
        if self.kv_memory is not None:
            from ..engine.paging import parse_kv_memory

            parse_kv_memory(self.kv_memory)
        return self


    def _check_pipeline(self) -> None:
        for key in ("pipeline_stages", "pipeline_micro_batches"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"--{key.replace('_', '-')} must be a positive integer, got {value}")
        if self.replicas is not None:
            raise ConfigError("--pipeline-stages puts one engine's layers on Ray actors: it does not combine with "
                              "--replicas")
        from ..cluster.pipeline import check_hop_and_rewind

        check_hop_and_rewind(self.pipeline_hop_ms, self.pipeline_rewind)


def require_extra() -> None:
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as err:
        raise ConfigError(f"outrider serve needs {err.name}, which is not installed: {EXTRA}") from None


def max_model_len(options: ServeOptions, context: int) -> int:
    """Rows per slot: the option, which may not exceed the model's context, or by default the
    smaller of DEFAULT_MAX_MODEL_LEN and the context."""
    if options.max_model_len is None:
        return min(DEFAULT_MAX_MODEL_LEN, context)
    if options.max_model_len > context:
        raise ConfigError(f"--max-model-len {options.max_model_len} is above the model's context of {context} "
                          f"tokens: pass --max-model-len {context} or less")
    return options.max_model_len


def engine_worker(options: ServeOptions, on_fatal=None):
    """Load the model and build its engine and worker thread (not started): (llm, worker,
    metrics, tokenizer lock). `build` serves it over HTTP; a cluster replica holds one each."""
    from ..llm import LLM
    from ..engine.loop import EngineLoop
    from ..engine.prefix_cache import PrefixCache
    from ..engine.paging import pages_of
    from .metrics import Metrics
    from .worker import EngineWorker

    llm = LLM(options.model, drafter=options.drafter, tree=options.tree, controller=options.controller,
              device=options.device, dtype=options.dtype, threads=options.threads,
              max_tree_nodes=options.max_tree_nodes, kv_dtype=options.kv_dtype, verifier=options.verifier)
    if options.pipeline_stages is not None:  # the target's layers on Ray actors (cluster/pipeline_llm.py)
        from ..cluster.pipeline_llm import split_llm
        from ..config import current

        split_llm(llm, options.pipeline_stages, hop_ms=options.pipeline_hop_ms, rewind=options.pipeline_rewind,
                  micro_batches=options.pipeline_micro_batches, threads=options.threads, runtime=current(),
                  dtype=options.dtype, kv_dtype=options.kv_dtype, address=options.address)
    lock = threading.Lock()  # the tokenizer is shared by the HTTP side and the engine thread

    def decode(ids: list[int]) -> str:
        with lock:
            return llm.decode(ids)

    prefix = PrefixCache(options.prefix_cache_block, options.prefix_cache_mb << 20) if options.prefix_cache else None
    pages = pages_of(options.kv_memory, llm.target, options.kv_page) if options.kv_memory is not None else None
    engine = EngineLoop(llm.target, llm.eos_ids, llm.speculator, decode=decode, max_running=options.max_running,
                        max_len=max_model_len(options, llm.target.config.max_position_embeddings),
                        max_kv_rows=options.max_kv_rows, chunk_size=options.chunk_size, prefix_cache=prefix,
                        kv_pages=pages, page_size=options.kv_page)
    metrics = Metrics(llm.name)
    worker = EngineWorker(engine, metrics, options.max_queue, on_fatal=on_fatal)
    return llm, worker, metrics, lock


def build(options: ServeOptions, log=None, on_fatal=None):
    """Load the model and return (app, state); the engine thread is not started yet. on_fatal(message):
    called from the engine thread after an error it cannot recover from."""
    require_extra()
    options.check()
    from .api import ServerState, create_app

    llm, worker, metrics, lock = engine_worker(options, on_fatal)
    state = ServerState(llm, worker, metrics, llm.name, options.api_key, lock,
                        max_body_bytes=options.max_body_mb << 20)
    return create_app(state), state


def listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound before anything loads or is printed: a port in use (or one this
    user may not bind) is one ConfigError line, not uvicorn's traceback after the "serving" line."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a port in TIME_WAIT is free
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise ConfigError(f"port {port} is in use: pass --port N") from None
        raise ConfigError(f"cannot listen on {host}:{port} ({err.strerror or err}): pass another --host or "
                          "--port") from None
    sock.set_inheritable(True)
    return sock


def sampled_tree_note(options: ServeOptions) -> str | None:
    """A --tree sampled:... server drafts only for sampled requests: said at start, and a greedy
    request is refused naming temperature (api.py)."""
    if options.drafter and str(options.tree).startswith("sampled:"):
        return (f"--tree {options.tree} draws draft siblings from the drafter's distribution: requests need "
                "temperature > 0 (a greedy one gets a 400 naming temperature; speculate: false decodes it "
                "without drafts)")
    return None


def prefix_cache_line(options: ServeOptions, worker) -> str:
    """The startup line on the prefix cache: its blocks and memory, or why it is off."""
    if not options.prefix_cache:
        return "prefix cache off (--no-prefix-cache)"
    engine = getattr(worker, "engine", None)
    cache, note = getattr(engine, "prefix_cache", None), getattr(engine, "prefix_cache_note", None)
    if cache is None and note:
        return f"prefix cache off: {note}"
    line = f"prefix cache on: blocks of {options.prefix_cache_block} tokens, up to {options.prefix_cache_mb} MiB"
    return line + (f" ({note})" if note else "")


def kv_line(worker) -> str:
    """The startup line on the K/V: a paged pool's pages, rows and MiB, or the slots."""
    engine = getattr(worker, "engine", None)
    if engine is None or not hasattr(engine, "cache"):  # a Router's engine is its replicas' Limits
        return "K/V: held by the replicas"
    if getattr(engine, "paged", False):
        cache = engine.cache
        mib = cache.nbytes() / (1 << 20)
        return (f"K/V: paged, {cache.num_pages} pages of {cache.page_size} rows ({mib:.0f} MiB), "
                f"up to {engine.scheduler.num_slots} requests at once as their pages allow")
    mib = engine.cache.nbytes() / (1 << 20)
    return f"K/V: {engine.scheduler.num_slots} slots of {engine.max_len} rows ({mib:.0f} MiB; --kv-memory pages it)"


def serve(options: ServeOptions, log=print, builder=None) -> int:
    """Run until drained or stopped; the exit code. builder(options, on_fatal=) -> (app, state):
    `build` (one engine here) or another front end's with the same worker interface
    (outrider/cluster/backend.py: replicas on Ray)."""
    require_extra()
    import uvicorn

    exit_code = 0
    server = None
    aborted = False

    def on_fatal(message: str) -> None:
        nonlocal exit_code
        exit_code = 1
        log(f"outrider serve: the engine failed ({message}); every request in flight got a 500; exiting with 1 "
            "so that a supervisor restarts the server", file=sys.stderr)
        if server is not None:
            server.should_exit = True

    sock = listen(options.host, options.port)
    try:
        app, state = (builder or build)(options, on_fatal=on_fatal)
    except BaseException:
        sock.close()
        raise
    state.worker.start()

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if state.worker.draining:
                if sig == signal.SIGINT:  # a second Ctrl-C: 503 to everyone in flight, stop now
                    nonlocal aborted
                    aborted = True
                    log("stopping now: answering the requests in flight with 503", file=sys.stderr)
                    state.worker.abort("the server stopped before this request finished (a second Ctrl-C): "
                                       "retry on another replica")
                    self.should_exit = True
                return
            log(f"draining: finishing {state.worker.in_flight} requests, "
                "refusing new ones", file=sys.stderr)
            state.worker.drain()

            def stop_when_idle():
                state.worker.wait_idle()
                self.should_exit = True

            threading.Thread(target=stop_when_idle, daemon=True).start()

    # every request has its answer before the server stops; the timeout bounds a client that
    # does not read it (a second Ctrl-C then exits within about 2 s)
    config = uvicorn.Config(app, host=options.host, port=options.port, log_level="warning",
                            timeout_graceful_shutdown=1)
    server = DrainingServer(config)
    port = sock.getsockname()[1]  # --port 0: the port the system chose
    log(f"outrider serve: {state.model_name} on http://{options.host}:{port}/v1", file=sys.stderr)
    log(f"outrider serve: {summary_line()}", file=sys.stderr)
    log(f"outrider serve: {prefix_cache_line(options, state.worker)}", file=sys.stderr)
    log(f"outrider serve: {kv_line(state.worker)}", file=sys.stderr)
    note = sampled_tree_note(options)
    if note:
        log(f"outrider serve: {note}", file=sys.stderr)
    try:
        server.run(sockets=[sock])
    finally:
        state.worker.stop(timeout=1)  # the step in progress (daemon thread: never blocks the exit)
    if aborted:  # everyone has had an answer; the interpreter's teardown (torch, transformers) takes
        sys.stdout.flush()  # seconds, which "stop now" should not
        sys.stderr.flush()
        os._exit(exit_code)
    return exit_code
