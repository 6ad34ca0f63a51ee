"""What a simulated replica's step costs: measured engine step times, never guessed constants.

A profile is a JSON file written by `outrider simulate --measure-profile` (measure.py) on the
machine being simulated:

    {"batches": [1, 2, 4, 8, 16], "widths": [1, 2, 4, 8],
     "seconds": [[...], ...],          # [len(batches)][len(widths)]: one engine step (a round) of
                                       #   B decoding sequences whose draft trees are W tokens wide
     "prefill_tokens": [32, 128, 512], "prefill_seconds": [...],   # the extra time of a step that
                                       #   also prefills that many prompt tokens
     "machine": ..., "command": ..., "date": ...}

`step(b, w)` is bilinear between grid points and linear beyond the last two (as
control/batch_cost.py reads its table); `prefill(n)` is linear between points, through the origin
below the first. The table is made non-decreasing both ways, as batch_cost.py does: a dip is
noise.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ...errors import ConfigError
from ...control.batch_cost import lerp  # linear between points, linear beyond the last two


@dataclass(frozen=True)
class CostModel:
    batches: tuple[int, ...]
    widths: tuple[int, ...]
    seconds: tuple[tuple[float, ...], ...]  # [len(batches)][len(widths)]
    prefill_tokens: tuple[int, ...] = (1,)
    prefill_seconds: tuple[float, ...] = (0.0,)
    source: str = ""

    def __post_init__(self) -> None:
        rows = [list(r) for r in self.seconds]
        for i, row in enumerate(rows):
            for j in range(len(row)):
                row[j] = max(row[j], row[j - 1] if j else 0.0, rows[i - 1][j] if i else 0.0)
        object.__setattr__(self, "seconds", tuple(tuple(r) for r in rows))

    def step(self, batch: int, width: float) -> float:
        """Seconds of one round for `batch` decoding sequences padded to `width` tokens each (0: none)."""
        if batch <= 0:
            return 0.0
        per_batch = [lerp(self.widths, list(row), width) for row in self.seconds]
        return lerp(self.batches, per_batch, batch)

    def prefill(self, tokens: int) -> float:
        """The extra seconds of a step that prefills `tokens` prompt tokens."""
        if tokens <= 0:
            return 0.0
        xs, ys = self.prefill_tokens, self.prefill_seconds
        if tokens < xs[0]:
            return ys[0] * tokens / xs[0]
        return max(0.0, lerp(xs, list(ys), tokens))

    def to_json(self) -> dict:
        return {"batches": list(self.batches), "widths": list(self.widths),
                "seconds": [list(r) for r in self.seconds], "prefill_tokens": list(self.prefill_tokens),
                "prefill_seconds": list(self.prefill_seconds)}

    @staticmethod
    def from_json(raw: dict, source: str = "") -> "CostModel":
        try:
            batches = tuple(int(b) for b in raw["batches"])
            widths = tuple(int(w) for w in raw["widths"])
            seconds = tuple(tuple(float(t) for t in row) for row in raw["seconds"])
            ptok = tuple(int(n) for n in raw.get("prefill_tokens", (1,)))
            psec = tuple(float(t) for t in raw.get("prefill_seconds", (0.0,)))
        except (KeyError, TypeError, ValueError) as err:
            raise ConfigError(f"cost profile {source or '(given)'}: not a profile ({type(err).__name__}: {err}); "
                              "write one with `outrider simulate --measure-profile FILE`") from None
        if (not batches or not widths or len(seconds) != len(batches) or any(len(r) != len(widths) for r in seconds)
                or len(ptok) != len(psec) or not ptok):
            raise ConfigError(f"cost profile {source or '(given)'}: its grid and table disagree in size")
        if sorted(batches) != list(batches) or sorted(widths) != list(widths) or sorted(ptok) != list(ptok):
            raise ConfigError(f"cost profile {source or '(given)'}: batches, widths and prefill_tokens must rise")
        return CostModel(batches, widths, seconds, ptok, psec, source)


def load_profile(path: str | Path) -> CostModel:
    """The profile in `path`; one-line ConfigError when it is missing or not a profile."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except OSError as err:
        raise ConfigError(f"cost profile {path}: cannot read it ({err.strerror or err})") from None
    except ValueError as err:
        raise ConfigError(f"cost profile {path}: not JSON ({err})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"cost profile {path}: not a profile (a JSON object is expected)")
    return CostModel.from_json(raw, str(path))
