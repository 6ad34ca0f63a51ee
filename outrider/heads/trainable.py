"""What `outrider train` needs of a head kind: its training job, behind the one interface
train/loop.py drives (train/trainables.py builds the job of the kind asked for, heads/kinds.py).

A kind's trainable.py gives `job(o, target, tokenizer, used, layer_ids)`: a job wrapping its
trainable module, with

    job.model         the nn.Module: parameters, calibrate, taps, state_tensors, export_config
    job.needs_logits  whether the target pass computes the target's logits (EAGLE-3's soft labels)
    job.first         the number of the first predicted position (EAGLE-3's step 0, DFlash's slot 1)
    job.weights()     [K] loss weight of each predicted position
    job.step(tb, step, rank) -> StepOutput: per position, the summed loss, scored rows and hits
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepOutput:
    """What one training step of a head gives the loop (train/loop.py), per predicted position k:
    the summed loss of its scored rows (with grad), their count and how many the head got right;
    the loop weights position k by `weights[k]` over the global count (so torchrun ranks add up)."""

    sums: list[torch.Tensor]  # [K] scalars with grad
    rows: list[int]  # [K]
    hits: list[float]  # [K]
    accepted: float = 0.0  # summed leading run of right predictions per block (DFlash), else 0
    blocks: int = 0  # blocks counted in `accepted`
