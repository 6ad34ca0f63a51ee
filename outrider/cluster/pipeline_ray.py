"""Pipeline stages as Ray actors (pipeline.py's "ray" transport).

Each stage is a `PipelineStage` in an actor of its own (`num_cpus` = threads), which loads the
model folder and keeps its layers. A forward is a chain of actor calls: stage 0's call gets the
batch, stage i's gets stage i-1's result as an ObjectRef, so the rows go from actor to actor
through Ray's object store and only the last stage's logits come back to the coordinator.

Micro-batches: several chains are submitted before any is waited on. An actor runs up to
`CONCURRENCY` calls at once but its forwards in the order they were sent (a ticket each,
`StageActor`): a simulated hop (a sleep) overlaps other work as a real link would, while the
layers and the K/V state see one forward at a time in order.

On a Ray cluster (`ray start --head` on one machine, `ray start --address HEAD` on the others),
`address` joins it and the stages spread over its machines (Ray's default placement; a stage
a machine where each has `threads` CPUs free and fewer: pin them with `placement` of
`ray.util.scheduling_strategies`, not done here). The model folder must be at the same path on
every machine.

A stage that dies (its process killed, out of memory) fails the forward with `StageDied`, one
line naming the stage and its layers.
"""

from __future__ import annotations

import threading
import time

from ..errors import ConfigError
from .pipeline import PipelineTarget, StageDied
from .pipeline_stage import PipelineStage, stage_bounds

START_S = 300  # seconds the stages may take to load
CONCURRENCY = 8  # calls an actor runs at once (hops sleeping, forwards waiting for their turn)


class StageActor:
    """A PipelineStage loaded in the actor's process, its forwards run in ticket order however Ray
    delivers them."""

    def __init__(self, path: str, index: int, count: int, options: dict):
        self.stage = PipelineStage.load(path, index, count, **options)
        self._turn = threading.Condition()
        self._next = 0

    def where(self) -> str:
        return self.stage.where()

    def busy(self) -> float:
        return self.stage.busy()

    def set_hop(self, hop_s: float) -> None:
        """A new simulated link delay (a measurement's sweep over hop latency)."""
        self.stage.hop_s = hop_s

    def run(self, ticket: int, cache_id: int, ops: list, batch, rows, hop: bool):
        if hop and self.stage.hop_s:  # the link: does not hold the stage
            time.sleep(self.stage.hop_s)
        with self._turn:
            self._turn.wait_for(lambda: self._next == ticket)
            try:
                return self.stage.forward(cache_id, ops, batch, rows, hop=False)
            finally:
                self._next += 1
                self._turn.notify_all()

    def create(self, cache_id: int, num_slots: int, max_len: int, dropped: list[int]) -> int:
        with self._turn:
            for old in dropped:
                self.stage.caches.pop(old, None)
            return self.stage.new_cache(cache_id, num_slots, max_len)


_REMOTE = None


def _remote_class():
    global _REMOTE
    if _REMOTE is None:
        import ray

        _REMOTE = ray.remote(StageActor)
    return _REMOTE


class RayStages:
    """The stages' actors; `run` submits each micro-batch's chain, then waits for all."""

    def __init__(self, ray, handles: list, bounds: list[tuple[int, int]], started_ray: bool):
        self.ray, self.handles, self.bounds = ray, handles, bounds
        self.started_ray = started_ray
        self._ticket = 0
        self._where = ray.get([h.where.remote() for h in handles])

    def where(self) -> list[str]:
        return self._where

    def new_cache(self, cache_id: int, num_slots: int, max_len: int, dropped: list[int]) -> int:
        return sum(self._get([h.create.remote(cache_id, num_slots, max_len, dropped) for h in self.handles]))

    def run(self, cache_id: int, ops: list, batches: list) -> list:
        refs = []
        for j, batch in enumerate(batches):
            ref = None
            for i, handle in enumerate(self.handles):
                ref = handle.run.remote(self._ticket, cache_id, ops if j == 0 else [], batch, ref, i > 0)
            self._ticket += 1
            refs.append(ref)
        return self._get(refs)

    def busy(self) -> list[float]:
        return self._get([h.busy.remote() for h in self.handles])

    def set_hop(self, hop_s: float) -> None:
        self._get([h.set_hop.remote(hop_s) for h in self.handles])

    def _get(self, refs):
        try:
            return self.ray.get(refs)
        except (self.ray.exceptions.RayActorError, self.ray.exceptions.ActorDiedError) as err:
            raise StageDied(self._dead_message(err)) from None

    def _dead_message(self, err) -> str:
        for i, handle in enumerate(self.handles):
            try:
                self.ray.get(handle.where.remote(), timeout=10)
            except Exception:
                lo, hi = self.bounds[i]
                return (f"pipeline stage {i} (layers {lo}-{hi - 1}) died: its process is gone; restart the "
                        "server (--pipeline-stages has no spare stages)")
        return f"a pipeline stage died: {str(err).splitlines()[0] if str(err) else type(err).__name__}"

    def close(self) -> None:
        for handle in self.handles:
            try:
                self.ray.kill(handle)
            except Exception:  # dead already
                pass
        if self.started_ray:
            self.ray.shutdown()


def ray_pipeline(path, whole, stages: int, *, hop_ms: float = 0.0, rewind: str = "trim", micro_batches: int = 1,
                 threads: int | None = None, runtime=None, dtype: str | None = None, address: str | None = None,
                 kv_dtype: str | None = None) -> PipelineTarget:
    """A PipelineTarget on `stages` Ray actors, each loading its layers from `path` (Ray started
    here with a CPU a stage, or joined at `address`, or the one this process already has)."""
    ray = _require_ray()
    cpus = threads or 1
    started = _start_ray(ray, address, stages * cpus)
    options = dict(device=str(whole.device), dtype=dtype, kv_dtype=kv_dtype, rewind=rewind, hop_s=hop_ms / 1000,
                   runtime=runtime, threads=cpus)
    actor = _remote_class().options(num_cpus=cpus, max_restarts=0, max_task_retries=0, max_concurrency=CONCURRENCY)
    bounds = stage_bounds(whole.config.num_layers, stages)
    handles = []
    try:
        handles = [actor.remote(str(path), i, stages, options) for i in range(stages)]
        ray.get([h.where.remote() for h in handles], timeout=START_S)
    except ray.exceptions.GetTimeoutError:
        _kill(ray, handles, started)
        raise ConfigError(f"the {stages} pipeline stages did not start within {START_S} s: Ray needs {stages * cpus} "
                          "free CPUs (`ray status` shows them)") from None
    except ray.exceptions.RayActorError as err:
        _kill(ray, handles, started)
        raise ConfigError(f"a pipeline stage failed to start: {last_error_line(err)}") from None
    transport = RayStages(ray, handles, bounds, started)
    return PipelineTarget(whole.config, transport, dtype=whole.dtype, device=whole.device, kv_dtype=whole.kv_dtype,
                          hop_s=hop_ms / 1000, micro_batches=micro_batches, rewind=rewind)


def last_error_line(err: Exception) -> str:
    """The last line of the exception an actor raised that names an error, without Ray's frame."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    errors = [line for line in lines if "Error:" in line and not line.startswith("ray.")]
    return errors[-1] if errors else lines[0] if lines else type(err).__name__


def _require_ray():
    try:
        import ray
    except ImportError:
        raise ConfigError("--pipeline-stages needs Ray, which is not installed: pip install 'outrider[cluster]'") from None
    return ray


def _start_ray(ray, address: str | None, cpus: int) -> bool:
    """Join `address`, or start a local Ray with `cpus` CPUs (backend.py's rule, without importing the
    serving side); True when this process started it. A Ray already running here is used as it is."""
    import logging

    if ray.is_initialized():
        return False
    if address is not None:
        ray.init(address=address, logging_level=logging.WARNING)
        return False
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, logging_level=logging.WARNING)
    return True


def _kill(ray, handles, started: bool) -> None:
    for handle in handles:
        try:
            ray.kill(handle)
        except Exception:
            pass
    if started:
        ray.shutdown()
