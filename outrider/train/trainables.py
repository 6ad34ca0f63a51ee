"""The heads `outrider train` trains, behind the one interface train/loop.py drives.

A job wraps a trainable module (train/eagle3_model.py, train/dflash_model.py) and says what the
loop needs to know about it:

    job.model         the nn.Module: parameters, calibrate, taps, state_tensors, export_config
    job.needs_logits  whether the target pass computes the target's logits (EAGLE-3's soft labels)
    job.first         the number of the first predicted position (EAGLE-3's step 0, DFlash's slot 1)
    job.weights()     [K] loss weight of each predicted position
    job.step(tb, step, rank) -> StepOutput: per position, the summed loss, scored rows and hits

The loop weights position k by weights[k] / (its scored rows over all ranks), so a torchrun
update is the single-process one, given the same anchors. DFlash's random anchors are drawn from
a generator seeded by (seed, step, rank): a resumed run draws the same ones; under torchrun each
rank draws its own for its share, so N processes train on other anchors than one process would
(the same recipe, not the same bits; the shipped head was trained in one process).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from .dflash_model import DFlashTrainable, StepOutput
from .eagle3_model import Eagle3Trainable


@dataclass
class Eagle3Job:
    model: Eagle3Trainable
    ttt_steps: int
    decay: float
    needs_logits = True
    first = 0

    def weights(self) -> list[float]:
        return [self.decay ** s for s in range(self.ttt_steps)]

    def step(self, tb, step: int, rank: int) -> StepOutput:
        r = self.model.ttt(tb.features, tb.tokens, tb.draft_logits, tb.valid, steps=self.ttt_steps, decay=self.decay)
        missing = self.ttt_steps - len(r.step_sums)  # steps past a short sequence
        zero = torch.zeros((), device=tb.tokens.device)
        return StepOutput(sums=list(r.step_sums) + [zero] * missing, rows=list(r.step_rows) + [0] * missing,
                          hits=[n * a for n, a in zip(r.step_rows, r.step_acc)] + [0.0] * missing)


@dataclass
class DFlashJob:
    model: DFlashTrainable
    seed: int
    anchors: int
    gamma: float
    needs_logits = False
    first = 1

    def weights(self) -> list[float]:
        return self.model.weights(self.gamma)

    def step(self, tb, step: int, rank: int) -> StepOutput:
        key = hashlib.sha256(f"dflash-anchors:{self.seed}:{step}:{rank}".encode()).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") >> 1)
        return self.model.step(tb, generator, self.anchors)


def build(o, target, tokenizer, used: torch.Tensor, layer_ids=None):
    """The job of run options `o` for `target` (a Decoder) with draft vocabulary `used` [Vd];
    layer_ids: EAGLE-3's (vllm semantics) from a checkpoint or --init-from, else the default."""
    if o.head == "eagle3":
        return Eagle3Job(Eagle3Trainable.for_target(target, used, seed=o.seed, layer_ids=layer_ids),
                         o.ttt_steps, o.decay)
    mask = o.mask_token if o.mask_token is not None else default_mask_token(tokenizer, target.config.vocab_size)
    model = DFlashTrainable.for_target(target, used, seed=o.seed, layers=o.layers, block_size=o.block_size,
                                       mask_token_id=mask, layer_ids=o.target_layers)
    return DFlashJob(model, o.seed, o.anchors, o.gamma)


def default_mask_token(tokenizer, vocab_size: int) -> int:
    """DFlash's MASK token when --mask-token is not given: the highest-id special token the
    tokenizer adds that is none of its named ones (bos, eos, pad, the chat template's), i.e. one
    that text never holds (SmolLM2: 16, `<empty_output>`); else the last id of the vocabulary."""
    named = set(getattr(tokenizer, "all_special_ids", None) or ())
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    spare = [i for i, tok in added.items() if getattr(tok, "special", False) and i not in named and i < vocab_size]
    return max(spare) if spare else vocab_size - 1
