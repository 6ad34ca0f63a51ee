"""Torch's CPU thread count during generation, following the cores other processes leave free.

Why. torch runs every multi-threaded CPU op (each GEMM of a decode step) as an OpenMP parallel
region that ends at a barrier: the op is done when its slowest thread is. Between regions GNU
libgomp's threads spin (about 0.6 ms here, GOMP_SPINCOUNT=300000) before they sleep, and a decode
step starts the next region long before that, so our N threads keep N cores busy. Beside a busy
process on one of those cores, each region waits at its barrier for the thread the scheduler has
just put behind that process, while our other thread spins: beside one busy neighbour, 2 threads
on 2 cores decode far slower than losing one core of two would explain. Passive waiting
(OMP_WAIT_POLICY=PASSIVE) mostly cures that but slows a quiet machine (every region then wakes a
sleeping thread); one thread per free core cures it at no quiet cost, since one thread has no
barrier to wait at. Measured: docs/benchmarks/2026-11-30-intel-xeon-avx512-amx.md, Shared CPUs;
the why: docs/kernels.md#shared-cpus.

How. `CpuShare` looks, every `period_s` of generation, at how many of the cores we may run on
other processes kept busy (/proc/stat over those cores, less our own CPU time), and sets torch's
thread count to the cores they left free, rounded (at least 1, at most the count the call began
with). `LLM.generate` ticks it after every engine step and puts the count back when the call
ends. It is off when the user chose a count (config `threads`: `LLM(threads=N)`, `--threads N`;
or OMP_NUM_THREADS in the environment), when config `follow_free_cores` is off, and where
/proc/stat does not exist (not Linux): then torch keeps its count. Unlike an OpenMP environment
variable it works whatever was imported first. Code that drives `engine.generate.generate_ids`
directly (the `outrider bench` runner) keeps a fixed count, so its timings compare like with
like; to follow the free cores there, step an EngineLoop inside `with share:` and call
`share.tick()` after each step, for a `share = CpuShare()`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

CpuTicks = Callable[[], "tuple[int, int] | None"]  # () -> (busy, total) ticks of our cores, or None


def cpu_ticks(cpus: frozenset[int] | None = None) -> tuple[int, int] | None:
    """(busy, total) clock ticks since boot summed over `cpus` (default: those we may run on),
    from /proc/stat; None where it cannot be read."""
    cpus = frozenset(os.sched_getaffinity(0)) if cpus is None else cpus
    busy = total = 0
    try:
        with open("/proc/stat") as f:
            for line in f:
                name, _, rest = line.partition(" ")
                if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
                    continue
                ticks = [int(x) for x in rest.split()]
                idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
                total += sum(ticks[:8])  # user nice system idle iowait irq softirq steal (guest is in user)
                busy += sum(ticks[:8]) - idle
    except (OSError, ValueError, IndexError):
        return None
    return (busy, total) if total else None


class CpuShare:
    """Sets torch's thread count to the cores other processes leave us (see the module doc).

    begin() at the start of a call, tick() once per round (cheap: it reads /proc/stat only when
    `period_s` has passed), end() when the call is done. A count chosen in the last `memory_s`
    carries into the next call, so short calls beside a busy neighbour start right."""

    def __init__(self, period_s: float = 0.5, memory_s: float = 5.0, ticks: CpuTicks = cpu_ticks,
                 own_cpu: Callable[[], float] = time.process_time, clock: Callable[[], float] = time.monotonic):
        self.period_s, self.memory_s = period_s, memory_s
        self._ticks, self._own_cpu, self._clock = ticks, own_cpu, clock
        self.cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        self.ceiling: int | None = None  # torch's count when the call began; restored by end()
        self.threads: int | None = None  # the count chosen last
        self.others = 0.0  # cores other processes kept busy in the last window
        self._last: tuple[float, float, tuple[int, int]] | None = None  # (clock, own cpu s, ticks)
        self._chosen_at = -float("inf")

    @staticmethod
    def wanted(threads: int, ceiling: int, cores: int, others: float) -> int:
        """The count for `others` busy cores: the free cores, rounded, in [1, ceiling]. Going up
        needs the extra core three-quarters free, going down it half taken, so a neighbour at the
        boundary does not flip the count every window."""
        free = cores - others
        down, up = int(free + 0.5), int(free + 0.25)
        target = down if down < threads else max(threads, up)
        return max(1, min(ceiling, target))

    def begin(self) -> None:
        self.ceiling = torch.get_num_threads()
        now = self._clock()
        if self.threads is not None and now - self._chosen_at < self.memory_s:
            torch.set_num_threads(min(self.threads, self.ceiling))
        else:
            self.threads = self.ceiling
        self._sample(now)

    def tick(self) -> None:
        now = self._clock()
        if self.ceiling is None or self._last is None or now - self._last[0] < self.period_s:
            return
        then, own_then, (busy_then, total_then) = self._last
        if not self._sample(now):
            return
        _, own_now, (busy_now, total_now) = self._last
        if total_now <= total_then:
            return
        machine = self.cores * (busy_now - busy_then) / (total_now - total_then)  # busy cores, ours too
        self.others = max(0.0, machine - (own_now - own_then) / (now - then))
        current = torch.get_num_threads()
        self.threads = self.wanted(current, self.ceiling, self.cores, self.others)
        self._chosen_at = now
        if self.threads != current:
            torch.set_num_threads(self.threads)

    def end(self) -> None:
        if self.ceiling is not None and torch.get_num_threads() != self.ceiling:
            torch.set_num_threads(self.ceiling)
        self.ceiling = None

    def __enter__(self) -> "CpuShare":
        self.begin()
        return self

    def __exit__(self, *exc) -> None:
        self.end()

    def _sample(self, now: float) -> bool:
        ticks = self._ticks()
        if ticks is None:
            return False
        self._last = (now, self._own_cpu(), ticks)
        return True


class FixedThreads:
    """CpuShare's interface, doing nothing: torch keeps the thread count it has."""

    def tick(self) -> None:
        pass

    def __enter__(self) -> "FixedThreads":
        return self

    def __exit__(self, *exc) -> None:
        pass


def cpu_share_for(threads: int | None, follow_free_cores: bool = True) -> CpuShare | FixedThreads:
    """A CpuShare, or FixedThreads where the user chose the thread count (config `threads`, or
    OMP_NUM_THREADS in the environment), turned it off (config `follow_free_cores`), or
    /proc/stat cannot be read."""
    if (threads is not None or not follow_free_cores or os.environ.get("OMP_NUM_THREADS")
            or cpu_ticks() is None):
        return FixedThreads()
    return CpuShare()
