"""Rotary position embeddings: each RoPE type's inverse frequencies, and the factor its cos and sin
are scaled by.

    inv_freq, scale = frequencies(RopeSpec.of(raw), rotary_dim)     # [rotary_dim / 2] float32, a float

Types (the `rope_type` of a config's `rope_parameters`, or of the older `rope_scaling`):

- default: 1 / theta^(2i / d) for i < d / 2.
- linear: the default divided by `factor` (positions interpolated by the factor).
- llama3 (Llama 3.1 / 3.2): frequencies whose wavelength is longer than
  original_max_position_embeddings / low_freq_factor are divided by `factor`; shorter than
  original / high_freq_factor kept; in between, a blend that moves linearly with
  original / wavelength from the divided to the kept value.
- yarn (YaRN): per frequency a blend of the interpolated (divided by `factor`) and the original
  value, by a ramp over the dimensions between the ones that turn beta_fast and beta_slow times
  over the original context; cos and sin scaled by 0.1 ln(factor) + 1 (or `attention_factor`).

- freq_factors (a GGUF's `rope_freqs` tensor, as llama.cpp's converter writes Llama 3's scaling):
  the default divided by the given per-frequency factors, one per rotating pair (`freq_factors`,
  a list of dim / 2 floats), as llama.cpp's rope applies them (theta / freq_factors[i]).

Each equals transformers' own (tests/test_rope.py runs small random models of each against it;
freq_factors, which transformers has not, equals the llama3 model it was written from:
tests/test_gguf_rope_freqs.py).
- dynamic (dynamic NTK): the default frequencies. transformers recomputes them from the length
  of the sequence once it passes max_position_embeddings, for every position of that forward
  while the keys cached earlier keep their old rotation, so its output past that length depends
  on how the text was cut into forwards; within it the frequencies are the default ones exactly,
  and the engine never passes it (`exact_context`).
- longrope (MiniCPM3, Phi-3): the default divided by `short_factor` (one per pair), cos and sin
  scaled by `attention_factor` (default sqrt(1 + ln(factor) / ln(original))). transformers
  switches every position to `long_factor` once the sequence passes
  original_max_position_embeddings, the same length-dependent switch, so the context is bounded
  there (`exact_context`); MiniCPM3-4B's original length is its whole context (32,768).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

TYPES = ("default", "linear", "llama3", "yarn", "freq_factors", "dynamic", "longrope")
LIST_PARAMS = ("freq_factors", "short_factor", "long_factor")  # one value a rotating pair


@dataclass(frozen=True)
class RopeSpec:
    """A config's rotary embedding: its type and parameters (sorted (key, value) pairs)."""

    rope_type: str = "default"
    theta: float = 10000.0
    params: tuple = ()

    @classmethod
    def of(cls, raw: dict, layer_type: str = "full_attention") -> "RopeSpec":
        """A config's RoPE; where transformers 5 keys `rope_parameters` by layer type (Gemma 3:
        "full_attention", "sliding_attention"), that of `layer_type`'s layers."""
        table = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        per_type = by_layer_type(table)
        if per_type:
            table = per_type.get(layer_type) or {}
        kind = str(table.get("rope_type", table.get("type", "default")) or "default")
        theta = float(table["rope_theta"] if per_type and "rope_theta" in table
                      else raw.get("rope_theta", table.get("rope_theta", 10000.0)))
        keep = {k: v for k, v in table.items() if k not in ("rope_type", "type", "rope_theta", "partial_rotary_factor")
                and not isinstance(v, (list, dict))}
        for name in LIST_PARAMS:  # freq_factors: a GGUF's rope_freqs (weights/gguf_convert.py)
            if isinstance(table.get(name), (list, tuple)):
                keep[name] = tuple(float(f) for f in table[name])
        if kind in ("yarn", "longrope") and "original_max_position_embeddings" not in keep:
            keep["original_max_position_embeddings"] = raw.get("original_max_position_embeddings",
                                                               raw.get("max_position_embeddings"))
        if kind == "longrope" and keep.get("factor") is None:  # Phi-3's: the ratio of the two lengths
            keep["factor"] = float(raw.get("max_position_embeddings", 2048)) / float(keep["original_max_position_embeddings"])
        return cls(kind, theta, tuple(sorted(keep.items())))

    def get(self, key: str, default=None):
        return dict(self.params).get(key, default)


def by_layer_type(table) -> dict:
    """`rope_parameters` keyed by layer type (transformers 5's form for Gemma 3), or {}."""
    if isinstance(table, dict) and table and all(isinstance(v, dict) for v in table.values()):
        return table
    return {}


def frequencies(spec: RopeSpec, dim: int, max_positions: int | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim / 2] float32, the cos / sin scale) of a head's `dim` rotating dimensions."""
    base = 1.0 / (spec.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))  # [dim / 2]
    if spec.rope_type in ("default", "dynamic"):  # dynamic: within max_position_embeddings (exact_context)
        return base, 1.0
    if spec.rope_type == "freq_factors":
        factors = torch.tensor(spec.get("freq_factors") or (), dtype=torch.float32)  # [dim / 2]
        if factors.shape != base.shape:
            raise ValueError(f"rope freq_factors has {factors.numel()} values; a head rotates {dim // 2} pairs")
        return base / factors, 1.0
    if spec.rope_type == "longrope":
        return _longrope(spec, dim)
    factor = float(spec.get("factor"))
    if spec.rope_type == "linear":
        return base / factor, 1.0
    if spec.rope_type == "llama3":
        return _llama3(base, factor, spec), 1.0
    if spec.rope_type == "yarn":
        return _yarn(spec, dim, factor, max_positions)
    raise ValueError(f"rope type {spec.rope_type!r} is not implemented (known: {', '.join(TYPES)})")


def exact_context(spec: RopeSpec, max_positions: int) -> int:
    """The longest sequence these frequencies compute exactly: longrope's switch to its long
    factors depends on how the text is cut into forwards, so it is not taken."""
    if spec.rope_type == "longrope":
        return min(int(max_positions), int(spec.get("original_max_position_embeddings")))
    return int(max_positions)


def _longrope(spec: RopeSpec, dim: int) -> tuple[torch.Tensor, float]:
    short = torch.tensor(spec.get("short_factor") or (), dtype=torch.float32)  # [dim / 2]
    if short.numel() != dim // 2:
        raise ValueError(f"longrope short_factor has {short.numel()} values; a head rotates {dim // 2} pairs")
    original, factor = float(spec.get("original_max_position_embeddings")), float(spec.get("factor"))
    scale = spec.get("attention_factor")
    if scale is None:
        scale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim  # [dim / 2]
    return 1.0 / (short * spec.theta ** shape), float(scale)


def _llama3(base: torch.Tensor, factor: float, spec: RopeSpec) -> torch.Tensor:
    original = float(spec.get("original_max_position_embeddings"))
    low, high = float(spec.get("low_freq_factor")), float(spec.get("high_freq_factor"))
    wavelength = 2 * math.pi / base  # [dim / 2]
    divided = torch.where(wavelength > original / low, base / factor, base)
    blend = (original / wavelength - low) / (high - low)  # 0 at the long end of the band, 1 at the short
    blended = (1 - blend) * divided / factor + blend * divided
    middle = (wavelength >= original / high) & (wavelength <= original / low)
    return torch.where(middle, blended, divided)


def _yarn(spec: RopeSpec, dim: int, factor: float, max_positions: int | None) -> tuple[torch.Tensor, float]:
    original = float(spec.get("original_max_position_embeddings") or max_positions)
    scale = spec.get("attention_factor")
    if scale is None:
        mscale, all_dim = spec.get("mscale"), spec.get("mscale_all_dim")
        scale = _mscale(factor, mscale) / _mscale(factor, all_dim) if mscale and all_dim else _mscale(factor, 1)
    fast, slow = spec.get("beta_fast") or 32, spec.get("beta_slow") or 1

    def turning_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over the context
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(spec.theta))

    low, high = turning_dim(fast), turning_dim(slow)
    if spec.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # [dim / 2]
    powers = spec.theta ** (torch.arange(0, dim, 2).float() / dim)
    keep = 1 - ramp  # the share of the original (extrapolated) frequency
    inv = (1.0 / (factor * powers)) * (1 - keep) + (1.0 / powers) * keep
    return inv, float(scale)


def _mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0
