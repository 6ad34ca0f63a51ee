"""Sampling parameters and the warp that turns target logits into the distribution p.

Everything here defines the target distribution p, so it is applied identically before plain
sampling and before verification: a speculative round reproduces exactly the distribution plain
sampling would. In order (vLLM's): the logit bias and the repetition, presence and frequency
penalties on the logits (spec/processing.py: they depend on the tokens so far, so each draft node
gets its own path's), then temperature, min-p, top-k and top-p (`warp_probs`).
`temperature == 0` means greedy: the argmax of the processed logits.
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
    top_p: number in (0, 1] (1 is off); seed: None or an int in [0, 2**64); min_p: in [0, 1]
    (0 is off: tokens below min_p times the likeliest token's probability are dropped);
    repetition_penalty: > 0 (1 is off; a token of the prompt or output has its logit divided by
    it when positive, multiplied when negative); presence_penalty / frequency_penalty: finite
    (0 is off; subtracted once / once per occurrence for tokens of the output); logit_bias:
    {token id: bias in [-100, 100]} added to the logits (kept as sorted (id, bias) pairs).
    """

    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    seed: int | None = None
    min_p: float = 0.0  # 0.0: off
    repetition_penalty: float = 1.0  # 1.0: off
    presence_penalty: float = 0.0  # 0.0: off
    frequency_penalty: float = 0.0  # 0.0: off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), sorted by id

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
        min_p = _number("min_p", self.min_p, "0 turns it off")
        if not (0.0 <= min_p <= 1.0):
            raise ConfigError(f"min_p must be in [0, 1] (0 turns it off), got {self.min_p}")
        repetition = _number("repetition_penalty", self.repetition_penalty, "1 turns it off")
        if not (math.isfinite(repetition) and repetition > 0.0):
            raise ConfigError(f"repetition_penalty must be a finite number > 0 (1 turns it off), got "
                              f"{self.repetition_penalty}")
        penalties = []
        for name in ("presence_penalty", "frequency_penalty"):
            value = _number(name, getattr(self, name), "0 turns it off")
            if not math.isfinite(value):
                raise ConfigError(f"{name} must be a finite number (0 turns it off), got {getattr(self, name)}")
            penalties.append(value)
        bias = _logit_bias(self.logit_bias)
        for name, value in (("temperature", t), ("top_k", top_k), ("top_p", top_p), ("seed", seed), ("min_p", min_p),
                            ("repetition_penalty", repetition), ("presence_penalty", penalties[0]),
                            ("frequency_penalty", penalties[1]), ("logit_bias", bias)):
            object.__setattr__(self, name, value)  # plain Python numbers from here on

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processes_logits(self) -> bool:
        """Whether the logits are changed before the warp (bias or penalties: spec/processing.py)."""
        return bool(self.logit_bias) or self.repetition_penalty != 1.0 or bool(self.presence_penalty) \
            or bool(self.frequency_penalty)


def _logit_bias(value) -> tuple[tuple[int, float], ...]:
    """{id: bias} or (id, bias) pairs -> sorted pairs of (int id >= 0, float bias in [-100, 100])."""
    items = value.items() if isinstance(value, dict) else value
    try:
        pairs = [(k, v) for k, v in items]
    except (TypeError, ValueError):
        raise TypeError(f"logit_bias must be a mapping {{token id: bias}}, got {type(value).__name__}") from None
    out = {}
    for key, bias in pairs:
        token = _integer("logit_bias key", key, "a token id")
        if token < 0:
            raise ConfigError(f"logit_bias keys must be token ids >= 0, got {key}")
        b = _number(f"logit_bias[{token}]", bias, "in [-100, 100]")
        if not (-100.0 <= b <= 100.0):
            raise ConfigError(f"logit_bias[{token}] must be in [-100, 100], got {bias}")
        out[token] = b
    return tuple(sorted(out.items()))


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
    if params.min_p > 0.0:  # relative to the likeliest token, after temperature (vLLM's)
        probs = torch.softmax(logits, dim=-1)
        floor = params.min_p * probs.max(-1, keepdim=True).values  # [..., 1]
        logits = logits.masked_fill(probs < floor, float("-inf"))
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

