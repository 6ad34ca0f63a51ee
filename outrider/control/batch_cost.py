"""The target's verify cost for a whole batch: forward time against (sequences, tokens each).

A batched verify forward pads every sequence's draft tree to the widest one (models/batch.py),
so its time is a function of the batch size B and that width T, and on a CPU it grows with both:
a verify of several tokens costs more 1-token forwards for a large batch than for one sequence
(docs/benchmarks/2026-11-30-intel-xeon-avx512-amx.md, Serving: "The batch's verify cost").
Speculation that pays for one user can slow a full server down; the cost controller
(cost.py) reads this table to back off as the batch grows.

    profile = load_or_measure_batch(model_path, target, folder, max_batch=32)
    profile.cost(16, 3)   # seconds for 16 sequences x 3 new tokens (bilinear between grid points)

Measured once per machine (the same key as profile.py, plus the grid) and cached as JSON.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..models.batch import pack
from ..models.decoder import Decoder
from .profile import profile_key, save_json

WIDTHS = (1, 2, 3, 4, 6, 8)  # new tokens per sequence
CONTEXT = 128  # committed rows each sequence attends to while measured


def batch_grid(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to the first power of two >= max_batch: one table serves every engine up to it."""
    grid = [1]
    while grid[-1] < max_batch:
        grid.append(grid[-1] * 2)
    return tuple(grid)


def lerp(xs: tuple[int, ...], ys: list[float], x: float) -> float:
    """Linear between points, linear beyond the last two (and flat below the first)."""
    if x <= xs[0] or len(xs) == 1:
        return ys[0]
    for a, b, ya, yb in zip(xs, xs[1:], ys, ys[1:]):
        if x <= b:
            return ya + (yb - ya) * (x - a) / (b - a)
    return ys[-1] + (ys[-1] - ys[-2]) * (x - xs[-1]) / (xs[-1] - xs[-2])


@dataclass(frozen=True)
class BatchCostProfile:
    batches: tuple[int, ...]
    widths: tuple[int, ...]
    seconds: tuple[tuple[float, ...], ...]  # [len(batches)][len(widths)], made non-decreasing both ways

    def __post_init__(self) -> None:
        # More sequences or more tokens never cost less; a dip is noise and would make the
        # controller prefer a wider round for nothing.
        rows = [list(r) for r in self.seconds]
        for i, row in enumerate(rows):
            for j in range(len(row)):
                low = max(row[j - 1] if j else 0.0, rows[i - 1][j] if i else 0.0)
                row[j] = max(row[j], low)
        object.__setattr__(self, "seconds", tuple(tuple(r) for r in rows))

    def cost(self, batch: int, width: int) -> float:
        """Seconds for one target forward over `batch` sequences of `width` new tokens each."""
        per_batch = [lerp(self.widths, list(row), width) for row in self.seconds]
        return lerp(self.batches, per_batch, batch)

    def to_json(self) -> dict:
        return {"batches": self.batches, "widths": self.widths, "seconds": self.seconds}

    @staticmethod
    def from_json(raw: dict) -> "BatchCostProfile":
        seconds = tuple(tuple(float(t) for t in row) for row in raw["seconds"])
        batches, widths = tuple(int(b) for b in raw["batches"]), tuple(int(w) for w in raw["widths"])
        if len(seconds) != len(batches) or any(len(row) != len(widths) for row in seconds):
            raise ValueError("grid and table disagree")
        return BatchCostProfile(batches, widths, seconds)


def measure_batch(target: Decoder, batches: tuple[int, ...], widths: tuple[int, ...] = WIDTHS,
                  context: int = CONTEXT, repeats: int = 2) -> BatchCostProfile:
    """Time chain verify forwards of every (batch, width) on a scratch cache of max(batches) slots.

    Each batch size gets one warm-up forward at its widest; each point keeps the fastest of
    `repeats` (the least disturbed by other processes)."""
    cache = target.new_cache(max(batches), context + max(widths) + 1)
    prefix = torch.randint(0, target.config.vocab_size, (context,), generator=torch.Generator().manual_seed(0))
    slots = list(range(max(batches)))
    target.forward(pack(slots, [0] * len(slots), [prefix] * len(slots), logits="none",
                        scratch_row=cache.scratch_row, device=target.device), cache)
    table = []
    for b in batches:
        def run(width: int) -> float:
            chain = torch.tensor([-1, *range(width - 1)])
            batch = pack(slots[:b], [context] * b, [prefix[:width]] * b, [chain] * b, logits="real",
                         scratch_row=cache.scratch_row, device=target.device)
            if target.device.type == "cuda":
                torch.cuda.synchronize(target.device)
            start = time.perf_counter()
            target.forward(batch, cache)
            if target.device.type == "cuda":
                torch.cuda.synchronize(target.device)
            return time.perf_counter() - start

        run(max(widths))
        table.append(tuple(min(run(w) for _ in range(repeats)) for w in widths))
    return BatchCostProfile(tuple(batches), tuple(widths), tuple(table))


def load_or_measure_batch(model_path: Path, target: Decoder, folder: Path, max_batch: int,
                          log=None) -> BatchCostProfile:
    """The cached table for a grid covering `max_batch`, else measured now and saved (or kept in
    memory when the folder cannot be written: it only saves time)."""
    batches = batch_grid(max_batch)
    key = profile_key(model_path, target)
    path = Path(folder) / f"batch-cost-{key}-{batches[-1]}.json"
    if path in _IN_MEMORY:
        return _IN_MEMORY[path]
    # this grid's table, else any larger one measured here before (it covers this one)
    larger = sorted(Path(folder).glob(f"batch-cost-{key}-*.json"), key=lambda p: _grid_max(p))
    for candidate in [path] + [p for p in larger if _grid_max(p) > batches[-1]]:
        try:
            return BatchCostProfile.from_json(json.loads(candidate.read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # none yet, or damaged: measured again
    say = log or (lambda line: print(line, file=sys.stderr, flush=True))
    say(f"measuring the batch verify-cost profile of {Path(model_path).name} up to {batches[-1]} sequences "
        "(once per machine)...")
    profile = measure_batch(target, batches)
    payload = {**profile.to_json(), "model": str(model_path), "device": str(target.device)}
    if not save_json(path, payload, "batch verify-cost profile"):
        _IN_MEMORY[path] = profile
    return profile


def _grid_max(path: Path) -> int:
    try:
        return int(path.stem.rsplit("-", 1)[1])
    except (IndexError, ValueError):
        return 0


_IN_MEMORY: dict[Path, BatchCostProfile] = {}
