"""The replicas' life, as the router sees it: alive, dead, restarted (a mixin of `Router`).

A replica is dead when its actor is gone (Ray raises RayActorError on its streams and calls; the
poller asks every live replica for its figures each `poll_s`, so an idle one is noticed too) or
its engine failed (an error out of `EngineLoop.step()`; its actor is then killed). It is marked
dead once, logged and counted, and the requests waiting for it at the router go elsewhere.

Then, while its slot has restarts left (`--replica-restarts N`, N per slot; 0: never), a new
actor is started in its slot with the same options, in a thread of its own: the router routes
to the other replicas meanwhile, and once the new one answers `ready` it takes the slot (a new
generation: what the old actor still raises is not taken for the new one's death) with an empty
history (no sessions, no tau) and the policy sees it alive again. A restart that fails uses one
of the slot's restarts too. When no replica is alive and none is restarting, `failed` is set
(/health 503) and `on_fatal` is called, as the single server does when its engine fails.
"""

from __future__ import annotations

import sys
import threading


class ReplicaLife:
    """Router state it uses: replicas, views, generation, restarts, _restarting, _sessions, queues,
    metrics, spawn, max_restarts, start_s, _cv, _stopped, failed, on_fatal, log, poll_s."""

    def health(self) -> dict:
        with self._cv:
            return {"replicas": len(self.views), "replicas_alive": sum(v.alive for v in self.views),
                    "replica_restarts": sum(self.restarted)}

    def _died(self, index: int, why: str, generation: int | None = None) -> None:
        """Mark a replica dead (once per generation), report it, restart it while its slot may,
        and stop the server's work when no replica is left."""
        with self._cv:
            view = self.views[index]
            stale = generation is not None and generation != self.generation[index]
            if not view.alive or self._stopped or stale:  # once; Ray going down with the server is no death
                return
            view.alive = False
            evicted = self.queues.evict(index)
            self._count(index)
            handle = self.replicas[index]
            restart = self._may_restart(index)
            live = sum(v.alive for v in self.views)
            fatal = not live and not self._restarting
            if fatal:
                self.failed = "every replica has died"
        for flight in evicted:  # they never reached it: sent elsewhere
            self._wake(flight, "died")
        self.metrics.deaths.labels(str(index)).inc()
        self._states()
        if restart:
            then = f"restarting it (restart {self.restarts[index]} of {self.max_restarts})"
        elif self.spawn is None or not self.max_restarts:
            then = "not restarted (--replica-restarts 0)" if self.spawn is not None else "not restarted"
        else:
            then = f"not restarted: its slot has used its {self.max_restarts} restarts"
        self.log(f"outrider serve: replica {index} died ({why}); {live} of {len(self.views)} alive; {then}; its "
                 "requests in flight are retried once elsewhere when nothing had been streamed, else failed with "
                 "503", file=sys.stderr)
        self._kill(handle)  # an engine that failed leaves a live actor: free its memory (and its CPUs)
        if restart:
            threading.Thread(target=self._bring_back, args=(index,), name=f"outrider-restart-{index}",
                             daemon=True).start()
        if fatal and self.on_fatal is not None:
            self.on_fatal("every replica has died")

    def _may_restart(self, index: int) -> bool:
        """Under the lock: take one of the slot's restarts, if it has one left."""
        if self._stopped or self.spawn is None or self.restarts[index] >= self.max_restarts:
            return False
        self.restarts[index] += 1
        self._restarting.add(index)
        return True

    def _bring_back(self, index: int) -> None:
        """A new actor in slot `index` (this thread waits for it); another try while restarts are left."""
        import ray

        while True:
            handle = None
            try:
                handle = self.spawn(index)
                where = ray.get(handle.ready.remote(), timeout=self.start_s)
                break
            except Exception as err:
                self._kill(handle)
                if self._stopped:  # the server is going down (Ray with it): no restart to report
                    with self._cv:
                        self._restarting.discard(index)
                    return
                lines = [line for line in str(err).splitlines() if line.strip()]
                with self._cv:
                    self._restarting.discard(index)
                    again = self._may_restart(index)
                    fatal = not again and not any(v.alive for v in self.views) and not self._restarting
                    if fatal:
                        self.failed = "every replica has died"
                self.log(f"outrider serve: replica {index} did not restart ({type(err).__name__}: "
                         f"{lines[0] if lines else ''}); " + ("trying again" if again else "no restart left"),
                         file=sys.stderr)
                self._states()
                if fatal and self.on_fatal is not None:
                    self.on_fatal("every replica has died")
                if not again:
                    return
        with self._cv:
            if self._stopped:  # the server stopped while it started
                self._restarting.discard(index)
                stopped = True
            else:
                stopped = False
                self.replicas[index] = handle
                self.generation[index] += 1
                self.restarted[index] += 1
                view = self.views[index]
                view.alive, view.kv_rows_used, view.recent_tau, view.sessions = True, 0, None, frozenset()
                self._sessions[index].clear()
                self._restarting.discard(index)
                self._count(index)
        if stopped:
            self._kill(handle)
            return
        self.metrics.restarted(index)
        self._states()
        self.log(f"outrider serve: replica {index} restarted ({self.restarts[index]} of {self.max_restarts} "
                 f"restarts): {where}", file=sys.stderr)

    def _states(self) -> None:
        with self._cv:
            live = sum(v.alive for v in self.views)
            restarting = len(self._restarting)
        self.metrics.replicas_now(live, len(self.views) - live - restarting, restarting)

    @staticmethod
    def _kill(handle) -> None:
        if handle is None:
            return
        try:
            import ray

            if ray.is_initialized():
                ray.kill(handle)
        except Exception:  # gone already
            pass

    def _poll(self) -> None:
        """Every poll_s: read each live replica's K/V rows; a replica that cannot answer because it
        is gone is marked dead even when no request is on it."""
        import ray

        while True:
            with self._cv:
                if self._cv.wait_for(lambda: self._stopped, self.poll_s):
                    return
                live = [(v.index, self.generation[v.index], self.replicas[v.index]) for v in self.views if v.alive]
            refs = [(i, gen, handle.stats.remote()) for i, gen, handle in live]
            for i, gen, ref in refs:
                try:
                    stats = ray.get(ref, timeout=max(5.0, 5 * self.poll_s))
                except ray.exceptions.RayActorError as err:
                    self._died(i, str(err).splitlines()[0], gen)
                    continue
                except Exception:  # slow to answer: keep the last figures
                    continue
                if stats.get("failed"):
                    self._died(i, f"its engine failed: {stats['failed']}", gen)
                    continue
                with self._cv:
                    if self.generation[i] == gen:
                        self.views[i].kv_rows_used = stats["kv_rows_used"]
