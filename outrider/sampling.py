"""Sampling parameters and the warp that turns target logits into the distribution p.

Temperature, top-k and top-p are applied to the target's logits before sampling and before
verification, so a speculative round reproduces exactly the distribution plain sampling would.
`temperature == 0` means greedy.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from .errors import ConfigError


MIN_TEMPERATURE = 1e-4  # below this (and above 0) temperature would overflow the logits; 0 is greedy
SEED_LIMIT = 2**64  # seeds are integers in [0, 2**64)


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen. Wrong types raise TypeError; wrong values ConfigError (one line).

    temperature: 0 (greedy) or a finite number >= MIN_TEMPERATURE; top_k: int >= 0 (0 is off);
    top_p: number in (0, 1] (1 is off); seed: None or an int in [0, 2**64).
    """

    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    seed: int | None = None

    def __post_init__(self) -> None:
        t = _number("temperature", self.temperature, "0 means greedy")
        if not math.isfinite(t) or t < 0.0:
            raise ConfigError(f"temperature must be a finite number >= 0 (0 means greedy), got {self.temperature}")
        if 0.0 < t < MIN_TEMPERATURE:
            raise ConfigError(f"temperature {self.temperature} is too small to sample with (the minimum is "
                              f"{MIN_TEMPERATURE}): use 0 for greedy")
        top_k = _integer("top_k", self.top_k, "0 turns it off")
        if top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0 turns it off), got {self.top_k}")
        top_p = _number("top_p", self.top_p, "1 turns it off")
        if not (0.0 < top_p <= 1.0):
            raise ConfigError(f"top_p must be in (0, 1] (1 turns it off), got {self.top_p}")
        seed = None if self.seed is None else _integer("seed", self.seed, "or None for a fresh one")
        if seed is not None and not (0 <= seed < SEED_LIMIT):
            raise ConfigError(f"seed must be an integer in [0, 2**64), got {self.seed}")
        for name, value in (("temperature", t), ("top_k", top_k), ("top_p", top_p), ("seed", seed)):
            object.__setattr__(self, name, value)  # plain Python numbers from here on

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _number(name: str, value, hint: str) -> float:
    """`value` as a float; TypeError unless it is a real number (bools and strings are not)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number ({hint}), got {type(value).__name__} {value!r}")
    try:
        return float(value)
    except OverflowError:
        return math.inf


def _integer(name: str, value, hint: str) -> int:
    """`value` as an int; TypeError unless it is an integer (bools and floats are not)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer ({hint}), got {type(value).__name__} {value!r}")
    return int(value)


def warp_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Target distribution after temperature, top-k and top-p.

    logits: [..., vocab] -> probs: [..., vocab] (float64 for float64 logits, else float32; rows
    sum to 1). Greedy returns the one-hot distribution of the argmax.
    """
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logits = logits.to(dtype)
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(dtype)
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass strictly before each token
        sorted_p = sorted_p.masked_fill(before >= params.top_p, 0.0)  # always keeps the first
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs

