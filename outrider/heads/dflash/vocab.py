"""A DFlash head reading out only some tokens of the target's output head (`dflash:NAME,vocab=N`:
which ones, drafters/dflash_vocab.py): the kept rows of the shared output head become the head's
own readout, in its quantization, with the vocab map to their target ids (heads/vocab_map.py).
The kept tokens' logits are the same numbers as before (the same rows)."""

from __future__ import annotations

from dataclasses import replace

import torch

from ..vocab_map import readout_rows
from .head import DFlashHead


def cut_readout(head: DFlashHead, ids: torch.Tensor) -> DFlashHead:
    """A new head whose readout keeps target ids `ids` ([m] long, sorted); `head` itself when
    they are the whole vocabulary."""
    c = head.config
    ids = ids.to(head.device)
    if ids.numel() >= c.vocab_size:
        return head
    rows = readout_rows(head.w.lm_head, ids, c.hidden_size, head.dtype, head.device)  # [m, H]
    weights = replace(head.w, lm_head=rows, draft_to_target=ids)
    return DFlashHead(replace(c, draft_vocab_size=int(ids.numel())), weights)
