"""`eagle3:NAME,vocab=N`: an EAGLE-3 head reading out only the draft tokens whose target ids are
among the N kept by `draft_vocab_ids` (ids 0..N-1 and the tokenizer's added tokens: a byte-pair
tokenizer's low ids are its common tokens, the `draft-model:NAME,vocab=N` rule).

A drafting step of the shipped SmolLM2 head is one decoder layer (about 4.1M multiply-adds) and
its readout (8,192 x 576, 4.7M): the readout is half of a step's products. Cutting it keeps the
same rows, so the kept tokens' logits are the same values (a float GEMM may sum them in another
order; a quantized readout is quantized from the same rows) and where the full readout's argmax
is kept, so is the draft.
Only proposals change: the target verifies every draft (exact). How large N should be is a
measurement (tau against a step's time): docs/learned-drafters.md, "The draft vocabulary".
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ...errors import ConfigError
from ..vocab_map import readout_rows


def cut_readout(config, weights, keep_targets: torch.Tensor):
    """(config, weights) of a head whose readout keeps only the draft ids mapping to a target id in
    `keep_targets` ([n] long); the same objects when every draft id is kept. Call before the
    head's matrices are quantized (an own float readout is then cut by index)."""
    Vd = config.draft_vocab_size
    device = weights.norm.device
    targets = (torch.arange(Vd, device=device) if weights.draft_to_target is None
               else weights.draft_to_target)  # [Vd]: target id of each draft id
    keep = torch.isin(targets, keep_targets.to(device)).nonzero().squeeze(1)  # [m] draft ids, ascending
    if keep.numel() == Vd:
        return config, weights
    if keep.numel() == 0:
        raise ConfigError(f"vocab=: none of this head's {Vd} draft tokens is among the kept ids; give a larger vocab=")
    rows = readout_rows(weights.lm_head, keep, config.hidden_size, weights.norm.dtype, device)  # [m, H]
    return (replace(config, draft_vocab_size=int(keep.numel())),
            replace(weights, lm_head=rows, draft_to_target=targets.index_select(0, keep)))
