"""The verifiers' randomness, behind four small methods.

A verifier never calls `torch.rand` itself: it asks an **rng** for a Bernoulli or a categorical
draw. Production passes `TorchRandom` (a torch generator, any device). The tests pass an
enumerating rng (tests/enumerate_law.py) that takes every branch in turn, each weighted by its
probability, so the exact law of a verifier's output can be computed and compared with p.

The protocol (one draw per call; the `_rows` forms are many independent draws in one call, for
vectorized paths that must not sync with the host per node):

    uniform_below(prob: float) -> bool                    True with probability prob (clamped to [0, 1])
    uniform_below_rows(probs: Tensor [n]) -> Tensor [n]   bool; entry i True with probability probs[i]
    categorical(probs: Tensor [vocab]) -> int             index i with probability probs[i] / probs.sum()
    categorical_rows(probs: Tensor [n, vocab]) -> Tensor [n]  long; one independent draw per row

`probs` are non-negative with a positive sum; they need not be normalised.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..sampling import sample


class Random(Protocol):
    def uniform_below(self, prob: float) -> bool: ...

    def uniform_below_rows(self, probs: torch.Tensor) -> torch.Tensor: ...

    def categorical(self, probs: torch.Tensor) -> int: ...

    def categorical_rows(self, probs: torch.Tensor) -> torch.Tensor: ...


class TorchRandom:
    """The protocol on a torch generator (None: torch's global generator on the CPU).

    The `_rows` draws stay on the device of their argument: no host sync. A generator lives on
    one device, so pass tensors on that device (or `None` for the global CPU generator).
    """

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    @staticmethod
    def seeded(seed: int, device: str | torch.device = "cpu") -> "TorchRandom":
        return TorchRandom(torch.Generator(device=device).manual_seed(seed))

    def uniform_below(self, prob: float) -> bool:
        if prob >= 1.0:
            return True
        if prob <= 0.0:
            return False
        device = self.generator.device if self.generator is not None else None
        return float(torch.rand((), dtype=torch.float64, device=device, generator=self.generator)) < prob

    def uniform_below_rows(self, probs: torch.Tensor) -> torch.Tensor:
        # probs: [n]; u in [0, 1), so P(u < prob) == prob, and prob 1 is always True.
        u = torch.rand(probs.shape, dtype=probs.dtype, device=probs.device, generator=self.generator)
        return u < probs

    def categorical(self, probs: torch.Tensor) -> int:
        return int(sample(probs, self.generator))

    def categorical_rows(self, probs: torch.Tensor) -> torch.Tensor:
        return sample(probs, self.generator)
