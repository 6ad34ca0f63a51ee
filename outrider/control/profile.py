"""The target's verify cost: forward time against the number of new tokens, on this machine.

Measured once per (model, dtype, device, threads, processor) and cached as JSON under the cache
directory (in memory only, with a warning, when that cannot be written), because it is a
property of the machine: on a 2-core CPU 1 to 4 new tokens cost about
what 1 does and 16 about twice, while a GPU stays flat much further. `cost(n)` interpolates.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import current
from ..models.batch import pack
from ..models.decoder import Decoder

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
# forwards before timing (with one, cost(1) came out above cost(2) in noisy minutes:
# docs/benchmarks/2026-11-30-intel-xeon-avx512-amx.md, Verify cost)
WARM_UP = 8


@dataclass(frozen=True)
class VerifyCostProfile:
    sizes: tuple[int, ...]
    seconds: tuple[float, ...]  # median forward time for each size, made non-decreasing

    def __post_init__(self) -> None:
        # More new tokens never cost less; a dip is measurement noise and would fool the
        # marginal rule into stopping at the size before it.
        running, smooth = 0.0, []
        for t in self.seconds:
            running = max(running, t)
            smooth.append(running)
        object.__setattr__(self, "seconds", tuple(smooth))

    def cost(self, n: int) -> float:
        """Seconds for one target forward over n new tokens (linear between measured sizes)."""
        if n <= self.sizes[0]:
            return self.seconds[0]
        for (a, ta), (b, tb) in zip(zip(self.sizes, self.seconds), zip(self.sizes[1:], self.seconds[1:])):
            if n <= b:
                return ta + (tb - ta) * (n - a) / (b - a)
        slope = (self.seconds[-1] - self.seconds[-2]) / (self.sizes[-1] - self.sizes[-2])
        return self.seconds[-1] + slope * (n - self.sizes[-1])

    def relative(self) -> dict[int, float]:
        return {n: t / self.seconds[0] for n, t in zip(self.sizes, self.seconds)}


def measure(target: Decoder, context: int = 256, repeats: int = 5) -> VerifyCostProfile:
    cache = target.new_cache(1, context + max(SIZES) + 1)
    prefix = torch.randint(0, target.config.vocab_size, (context,), generator=torch.Generator().manual_seed(0))
    target.forward(pack([0], [0], [prefix], logits="none", scratch_row=cache.scratch_row,
                        device=target.device), cache)
    warm = pack([0], [context], [prefix[:1]], scratch_row=cache.scratch_row, device=target.device)
    for _ in range(WARM_UP):  # the first steps after a prefill run slow (caches, buffers): not a step's cost
        target.forward(warm, cache)
    seconds = []
    for n in SIZES:
        chain = torch.tensor([-1, *range(n - 1)])
        batch = pack([0], [context], [prefix[:n]], [chain], scratch_row=cache.scratch_row, device=target.device)
        times = []
        for _ in range(repeats + 1):
            _sync(target)
            start = time.perf_counter()
            target.forward(batch, cache)
            _sync(target)
            times.append(time.perf_counter() - start)
        seconds.append(statistics.median(times[1:]))
    return VerifyCostProfile(SIZES, tuple(seconds))


def _sync(target: Decoder) -> None:
    if target.device.type == "cuda":
        torch.cuda.synchronize(target.device)


def _native_identity() -> str:
    from ..kernels import native
    from ..kernels.decoder_layer import enabled

    lib = native.library()
    return f"{native._state['path'].name if lib is not None else 'none'},layer={int(enabled())}"


def profile_key(model_path: Path, target: Decoder) -> str:
    parts = [str(Path(model_path).resolve()), str(target.quantization or target.dtype), str(target.device),
             str(torch.get_num_threads()),
             platform.processor() or platform.machine(), torch.__version__,
             # the CPU product path: per-machine choice since cpu_linear.py (older profiles timed W @ x.T)
             "linear:" + current().linear,
             f"warm-up:{WARM_UP}",  # profiles measured after a single warm-up forward are measured again
             # the native kernel as built (its file name hashes the C sources, flags, compiler and
             # CPU) and whether the native layer runs: a kernel change re-measures the profile
             "native:" + _native_identity()]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def load_or_measure(model_path: Path, target: Decoder, folder: Path, log=None) -> VerifyCostProfile:
    """The cached profile from `folder`, else measured now (a few seconds) and saved there.

    The profile only saves time, so a folder that cannot be written (a read-only cache) does not
    stop generation: the measured profile is kept in memory for this process instead, and one
    line, `warning: ...`, says so on stderr, once per folder."""
    path = Path(folder) / f"verify-cost-{profile_key(model_path, target)}.json"
    if path in _IN_MEMORY:
        return _IN_MEMORY[path]
    try:
        raw = json.loads(path.read_text())
        return VerifyCostProfile(tuple(raw["sizes"]), tuple(raw["seconds"]))
    except (OSError, ValueError, KeyError, TypeError):
        pass  # none yet, or a damaged or unreadable one: measured again
    if log:
        log(f"measuring the verify-cost profile of {model_path} (once per machine)...")
    profile = measure(target)
    if not save_json(path, {"sizes": profile.sizes, "seconds": profile.seconds,
                            "model": str(model_path), "device": str(target.device)}, "verify-cost profile"):
        _IN_MEMORY[path] = profile
    return profile


def save_json(path: Path, payload: dict, what: str) -> bool:
    """Write `payload` to `path` atomically; False (and one warning per folder) when it cannot be."""
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(payload))
        os.replace(tmp, path)
        return True
    except OSError as err:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        if path.parent not in _WARNED:
            _WARNED.add(path.parent)
            print(f"warning: cannot save the {what} in {path.parent} ({err.strerror or err}); "
                  "it is kept in memory for this process and measured again next time (make the folder "
                  "writable or set OUTRIDER_CACHE_DIR to keep it)", file=sys.stderr)
        return False


_IN_MEMORY: dict[Path, VerifyCostProfile] = {}  # profiles that could not be saved, by their path
_WARNED: set[Path] = set()  # folders already warned about
