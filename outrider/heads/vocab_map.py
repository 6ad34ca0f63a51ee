"""A reduced draft vocabulary's map to the target's: draft id d is target id `m[d]` (m: [Vd] long,
or None for the identity). Shared by the heads (EAGLE-3, DFlash) and the drafted block."""

from __future__ import annotations

import torch


def to_target_ids(m: torch.Tensor | None, draft_ids: torch.Tensor) -> torch.Tensor:
    """Draft-vocabulary ids -> target ids (same shape)."""
    return draft_ids if m is None else m[draft_ids.to(m.device)]


def to_target_logits(m: torch.Tensor | None, logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """[..., Vd] -> [..., V]: the draft logits at their target ids, -inf elsewhere (what vLLM does)."""
    if m is None:
        return logits
    full = logits.new_full((*logits.shape[:-1], vocab), float("-inf"))
    return full.index_copy_(-1, m.to(logits.device), logits)
