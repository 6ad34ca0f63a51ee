"""A bench that samples: the run's sampling settings and the seed each prompt is sampled with.

    temperature = 1.0   # in a methods file, or `outrider bench --temperature 1` (0: greedy, the default)
    top_p = 0.95        # or --top-p (1: off)
    seed = 0            # or --seed: the run seed every prompt's seed derives from

At temperature 0 the bench is greedy and its audit is token equality (results.py). Above 0 every
method (ours and the transformers peer) samples the target's warped distribution (temperature,
then top-p; sampling.warp_probs), and the audit is distributional (bench/audit.py).

Seeds. Each (workload, prompt, sample, role) gets its own seed, a pure function of the run seed:

    prompt_seed(run_seed, workload, prompt_id, sample, role)
        = the first 8 bytes (little-endian) of sha256("{run_seed}/{role}/{workload}/{prompt_id}/{sample}"),
          shifted right by one bit (so in [0, 2**63)); `workload` is the workload's name, a jsonl
          file's by its file name alone ("jsonl:prompts.jsonl": `seed_name`), so that moving the
          file does not change the samples

Before a request is added, torch's generator is seeded with it (`torch.manual_seed`), and the
request itself gives no seed: the engine then draws the request's seed from that generator
(engine/sequence.with_seed), so the run is repeatable, and the request is verified by the verifier
of most acceptance (rejection sampling on a sampled chain, multi-draft rejection sampling on
sampled siblings) rather than by the walk that a request with a seed of its own gets
(spec/verifiers.py): the acceptance a paper's temperature-1 table reports. The timed runs use
role "timed", sample 0, so every method of a prompt draws the same request seed: walk-verified
methods (ngram, suffix: drafts without probabilities) then commit exactly the autoregressive
baseline's text, and the others the same law. The audit draws each method's samples with a role
of its own, so its samples are independent of the reference's.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from ..errors import ConfigError
from ..sampling import SamplingParams

TIMED = "timed"  # the role of the timed runs' seeds
REFERENCE = "audit:autoregressive"  # the audit's reference samples


def seed_name(workload: str) -> str:
    """The workload's name in a seed: "jsonl:DIR/prompts.jsonl" -> "jsonl:prompts.jsonl"."""
    kind, colon, path = workload.partition(":")
    return f"{kind}:{path.replace(chr(92), '/').rsplit('/', 1)[-1]}" if colon and kind == "jsonl" else workload


def prompt_seed(run_seed: int, workload: str, prompt_id: str, sample: int = 0, role: str = TIMED) -> int:
    """The seed of one (workload, prompt, sample, role): see the module docstring. -> [0, 2**63)."""
    key = f"{run_seed}/{role}/{seed_name(workload)}/{prompt_id}/{sample}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") >> 1


@dataclass(frozen=True)
class BenchSampling:
    """The run's sampling: temperature 0 is greedy (top_p then unused)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    @staticmethod
    def of(config) -> "BenchSampling":
        """From a BenchConfig (its temperature, top_p, seed fields), checked."""
        return BenchSampling(config.temperature or 0.0, 1.0 if config.top_p is None else config.top_p,
                             config.seed or 0).check()

    def check(self) -> "BenchSampling":
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ConfigError(f"seed must be an integer >= 0, got {self.seed!r}")
        try:
            SamplingParams(temperature=self.temperature, top_p=self.top_p)  # top-p checked even when greedy
        except TypeError as err:
            raise ConfigError(str(err)) from None
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def params(self) -> SamplingParams:
        """The requests' parameters: no seed of their own (see the module docstring)."""
        return SamplingParams(temperature=self.temperature, top_p=self.top_p if not self.greedy else 1.0)

    def seed_torch(self, workload: str, prompt_id: str, sample: int = 0, role: str = TIMED) -> int:
        """Seed torch's generator for one request (greedy: nothing to seed); returns the seed."""
        seed = prompt_seed(self.seed, workload, prompt_id, sample, role)
        if not self.greedy:
            torch.manual_seed(seed)
        return seed

    def describe(self) -> dict:
        return {"temperature": self.temperature, "top_p": self.top_p, "seed": self.seed}
