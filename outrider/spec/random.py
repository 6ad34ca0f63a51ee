"""The verifiers' randomness: every draw is a pure function of (seed, position, stream, index).

A verifier never calls `torch.rand` itself: it asks an **rng** for a Bernoulli or a categorical
draw, and says which output position the draw decides. Production passes `PositionalRandom`:
a counter-based generator, so the uniform behind a draw depends only on the request's seed, the
absolute position of the token it decides, its stream (accept test, token, drafter) and an index
(the sibling tried at that position). Nothing carries over from call to call, which gives:

- the same seed gives the same text whatever the drafter's state, the controller's draft lengths
  or the rest of the batch (no hidden counter advances differently);
- the tree walk commits at position t the token that plain sampling would commit there,
  `categorical(p_t, u_t)` with the same u_t: with the same seed, speculation verified by the walk
  (drafters without probabilities, and every request that gives a seed: spec/verifiers.py) gives
  *exactly* the autoregressive sample, not only its law;
- the same integers on every device (the mixing is integer arithmetic, CPU and CUDA alike).

Why reusing a position's uniform across rounds stays exact: a round consults the draws of the
positions up to its first rejection and commits exactly those positions; draws at later
positions decided nothing, so they are still independent of everything committed when the
next round (which starts after the committed positions) uses them. Within a round every
consulted draw has its own key: accept tests use (ACCEPT, offset, sibling index), committed
tokens (TOKEN, offset, 0), a drafter's samples its own streams, except a chain drafted for the
walk: coupled, it draws its draft at t with the walk's own (TOKEN, t, 0) uniform, which the walk's
committed tokens never depend on through the drafts (drafters/capabilities.py `couples`).
Siblings at the same depth of a tree share their position's uniform, but a walk visits one node
per depth.

The protocol (offset 0 is the first new token, the one after the root; an rng view made by
`at(first)` maps it to absolute position `first`):

    uniform_below(prob, offset=0, index=0) -> bool           True with probability prob
    uniform_below_rows(probs [n], offsets [n]) -> bool [n]     one test per row, index 0
    categorical(probs [vocab], offset=0, index=0) -> int       i with probability probs[i] / sum
    categorical_rows(probs [n, vocab], offsets [n]) -> long [n]
    at(first) -> rng            the view whose offset 0 is absolute position `first`
    drafting() -> rng           the same positions on the drafter's own streams

`probs` are non-negative with a positive sum; they need not be normalised. The tests pass an
enumerating rng (tests/enumerate_law.py) that takes every branch of every draw in turn, so the
exact law of a verifier's output can be computed and compared with p.
"""

from __future__ import annotations

from typing import Protocol

import torch

_M = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB
ACCEPT, TOKEN = 0, 1  # the verifier's streams; a drafter's are these plus DRAFTING
DRAFTING = 2
MAX_SEED = 1 << 64  # seeds are integers in [0, 2**64)


class Random(Protocol):
    def uniform_below(self, prob: float, offset: int = 0, index: int = 0) -> bool: ...

    def uniform_below_rows(self, probs: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor: ...

    def categorical(self, probs: torch.Tensor, offset: int = 0, index: int = 0) -> int: ...

    def categorical_rows(self, probs: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor: ...

    def at(self, first: int) -> "Random": ...

    def drafting(self) -> "Random": ...


# -- the counter-based uniform: splitmix64's finaliser, in Python ints and in int64 tensors --------
def _mix(z: int) -> int:
    z = ((z ^ (z >> 30)) * _MUL1) & _M
    z = ((z ^ (z >> 27)) * _MUL2) & _M
    return z ^ (z >> 31)


def _signed(c: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix_t(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _shr(z, 30)) * _signed(_MUL1)  # int64 products wrap mod 2**64, as the bits need
    z = (z ^ _shr(z, 27)) * _signed(_MUL2)
    return z ^ _shr(z, 31)


def uniform_reference(seed: int, position: int, stream: int, index: int) -> float:
    """The uniform in [0, 1) behind one draw, in plain Python (the tensor path must match it)."""
    h = _mix((seed + _GOLDEN) & _M)
    h = _mix(((h ^ position) + _GOLDEN) & _M)
    h = _mix(((h ^ ((stream << 32) | index)) + _GOLDEN) & _M)
    return (h >> 11) * 2.0**-53


def uniforms(seed: int, positions: torch.Tensor, stream: int, index: int = 0) -> torch.Tensor:
    """positions: [n] long (absolute) -> [n] float64 in [0, 1), on positions' device, no host sync."""
    h0 = _signed(_mix((seed + _GOLDEN) & _M))
    h = _mix_t((positions.long() ^ h0) + _signed(_GOLDEN))
    h = _mix_t((h ^ ((stream << 32) | index)) + _signed(_GOLDEN))
    return _shr(h, 11).double() * 2.0**-53


def categorical_from_uniform(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw. probs: [n, vocab] (>= 0, positive sums); u: [n] in [0, 1) -> [n] long.

    Token i covers [cdf[i-1], cdf[i]) of the mass, so a zero-probability token covers nothing;
    rounding can only push u * total past the last bucket, which then goes to the last token
    with positive probability.
    """
    cdf = probs.double().cumsum(-1)  # [n, vocab]
    x = (u.to(cdf.device) * cdf[:, -1]).unsqueeze(-1)  # [n, 1]
    index = torch.searchsorted(cdf, x, right=True)[:, 0]  # [n] first bucket whose end exceeds x
    last = probs.shape[-1] - 1 - (probs > 0).flip(-1).long().argmax(-1)  # [n] last positive token
    return torch.minimum(index, last)


class PositionalRandom:
    """The protocol on (seed, position, stream, index) -> uniform. Cheap to copy; no state."""

    def __init__(self, seed: int, first: int = 0, stream_base: int = 0) -> None:
        if not (isinstance(seed, int) and 0 <= seed < MAX_SEED):
            raise ValueError(f"seed must be an integer in [0, 2**64), got {seed!r}")
        self.seed = seed
        self.first = first
        self.stream_base = stream_base

    def at(self, first: int) -> "PositionalRandom":
        return PositionalRandom(self.seed, first, self.stream_base)

    def drafting(self) -> "PositionalRandom":
        return PositionalRandom(self.seed, self.first, self.stream_base + DRAFTING)

    def _u(self, offset: int, stream: int, index: int) -> float:
        return uniform_reference(self.seed, self.first + offset, self.stream_base + stream, index)

    def _u_rows(self, offsets: torch.Tensor, stream: int) -> torch.Tensor:
        return uniforms(self.seed, offsets + self.first, self.stream_base + stream)

    def uniform_below(self, prob: float, offset: int = 0, index: int = 0) -> bool:
        return self._u(offset, ACCEPT, index) < prob

    def uniform_below_rows(self, probs: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        # probs: [n]; u in [0, 1), so P(u < prob) == prob, and prob 1 is always True.
        return self._u_rows(offsets.to(probs.device), ACCEPT).to(probs.dtype) < probs

    def categorical(self, probs: torch.Tensor, offset: int = 0, index: int = 0) -> int:
        u = torch.tensor([self._u(offset, TOKEN, index)], dtype=torch.float64)
        return int(categorical_from_uniform(probs.reshape(1, -1), u)[0])

    def categorical_rows(self, probs: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return categorical_from_uniform(probs, self._u_rows(offsets.to(probs.device), TOKEN))
