"""The heads `outrider train` trains, behind the one interface train/loop.py drives.

Each head kind's package gives its job (heads/<kind>/trainable.py `job`; the interface:
heads/trainable.py), found through the kind's registration (heads/kinds.py): a job wraps the
kind's trainable module and says what the loop needs to know about it (`model`, `needs_logits`,
`first`, `weights()`, `step(tb, step, rank)`).

The loop weights position k by weights[k] / (its scored rows over all ranks), so a torchrun
update is the single-process one, given the same anchors. DFlash's random anchors are drawn from
a generator seeded by (seed, step, rank): a resumed run draws the same ones; under torchrun each
rank draws its own for its share, so N processes train on other anchors than one process would
(the same recipe, not the same bits; the shipped head was trained in one process).
"""

from __future__ import annotations

import torch

from ..heads.kinds import kind_named


def build(o, target, tokenizer, used: torch.Tensor, layer_ids=None):
    """The job of run options `o` for `target` (a Decoder) with draft vocabulary `used` [Vd], by
    the kind `o.head` names; layer_ids: EAGLE-3's (vllm semantics) from a checkpoint or
    --init-from, else the default."""
    return kind_named(o.head).part("train_job")(o, target, tokenizer, used, layer_ids)
