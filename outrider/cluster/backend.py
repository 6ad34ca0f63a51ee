"""`outrider serve --replicas N`: Ray started or joined, N replicas, one HTTP front end.

    outrider serve --replicas 2 --policy sticky             a local Ray instance, started and stopped with the server
    outrider serve --replicas 4 --address auto              an existing cluster (`ray start --head` on one machine)

`build` is `serve.server.build` for a cluster: it returns the same (app, state), so `serve`
runs, drains and stops it the same way. The app is serve/api.py's; its worker is a `Router`
(router.py) in front of N `Replica` actors (replica.py), each with `--threads` CPUs (1 if not
given) and the engine `outrider serve` would build. The front end loads the tokenizer and the
model's config only (`FrontModel`), not its weights. A replica that dies is replaced by a new
actor in its slot, at most `--replica-restarts` times a slot (life.py). Stopping the server kills
its actors (those started since too: they take their slot in the same list) and, when it started
Ray, shuts Ray down.
"""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

from ..errors import ConfigError
from ..llm import LLM

EXTRA = "pip install 'outrider[cluster]'"
START_S = 300  # seconds the replicas may take to load their model


class FrontModel(LLM):
    """The model as the HTTP front end needs it: tokenizer, chat template, eos ids, config (the
    vocabulary's size), grammars; no weights and no engine (`generate` is not available)."""

    def __init__(self, name: str, path):
        from ..models.config import ModelConfig
        from ..weights.tokenizer import eos_ids_of, load_tokenizer

        self.name, self.path = name, path
        self.tokenizer = load_tokenizer(path)
        self.eos_ids = eos_ids_of(path, self.tokenizer)
        self.target = SimpleNamespace(config=ModelConfig.load(path))
        self._grammars = None


def require_ray():
    try:
        import ray
    except ImportError:
        raise ConfigError(f"--replicas and --address need Ray, which is not installed: {EXTRA}") from None
    return ray


def build(options, log=print, on_fatal=None):
    """Start (or join) Ray and the replicas; return (app, state) as `serve.server.build` does."""
    from ..serve.server import require_extra

    require_extra()
    options.check()
    ray = require_ray()
    from .policies import make_policy

    policy = make_policy(options.policy)  # an unknown policy is refused before anything starts
    replicas = options.replicas or 1
    cpus = options.threads or 1
    started = start_ray(ray, options.address, replicas * cpus)
    handles: list = []

    def stop() -> None:
        for handle in handles:
            try:
                ray.kill(handle)
            except Exception:  # dead already
                pass
        if started:
            ray.shutdown()

    try:
        return _start(ray, options, policy, replicas, cpus, handles, stop, log, on_fatal)
    except BaseException:
        stop()
        raise


def start_ray(ray, address: str | None, cpus: int) -> bool:
    """Join `address`, or start a local Ray with `cpus` CPUs; True when this process started it.
    A Ray already initialised in this process (tests, a notebook) is used as it is."""
    if ray.is_initialized():
        return False
    if address is not None:
        ray.init(address=address, logging_level=logging.WARNING)
        return False
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, logging_level=logging.WARNING)
    return True


def _start(ray, options, policy, replicas: int, cpus: int, handles: list, stop, log, on_fatal):
    from .. import config
    from ..catalog.packages import DEFAULT_MODEL
    from ..catalog.resolve import resolve_model
    from ..serve.api import ServerState, create_app
    from .metrics import ClusterMetrics
    from .replica import remote_class
    from .router import Router

    path = resolve_model(options.model or DEFAULT_MODEL)  # a model not pulled is refused here, not in N actors
    actor = remote_class(num_cpus=cpus, max_restarts=0, max_task_retries=0)
    handles += [actor.remote(options, i, config.current()) for i in range(replicas)]
    log(f"outrider serve: starting {replicas} replicas ({cpus} CPU each) on Ray", file=_stderr())
    try:
        where = ray.get([h.ready.remote() for h in handles], timeout=START_S)
    except ray.exceptions.GetTimeoutError:
        raise ConfigError(f"the {replicas} replicas did not start within {START_S} s: the Ray cluster needs "
                          f"{replicas * cpus} free CPUs (`ray status` shows them); lower --replicas or --threads"
                          ) from None
    except ray.exceptions.RayActorError as err:  # its __init__ raised: say why in one line
        raise ConfigError(f"a replica failed to start: {_cause(err)}") from None
    log(f"outrider serve: {'; '.join(where)}", file=_stderr())
    limits = ray.get(handles[0].limits.remote())
    front = FrontModel(limits.model_name, path)
    lock = threading.Lock()  # the front end's tokenizer: the HTTP side's and a moved request's text (router)

    def decode(ids: list[int]) -> str:
        with lock:
            return front.decode(ids)

    def spawn(index: int):  # a new actor in a dead replica's slot (router.py, life.py)
        return actor.remote(options, index, config.current())

    router: Router | None = None
    metrics = ClusterMetrics(handles, alive=lambda: [v.index for v in router.views if v.alive])
    router = Router(handles, limits, policy, metrics, options.max_queue, on_fatal=on_fatal, on_stop=stop, log=log,
                    decode=decode, spawn=spawn, restarts=options.replica_restarts, start_s=START_S)
    state = ServerState(front, router, metrics, limits.model_name, options.api_key, lock,
                        max_body_bytes=options.max_body_mb << 20)
    return create_app(state), state


def _cause(err: Exception) -> str:
    """The last line of the exception a replica's constructor raised, without Ray's frame."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    errors = [line for line in lines if "Error:" in line and not line.startswith("ray.")]
    return errors[-1] if errors else lines[0] if lines else type(err).__name__


def _stderr():
    import sys

    return sys.stderr
