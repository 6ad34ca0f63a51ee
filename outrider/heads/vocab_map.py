"""A reduced draft vocabulary's map to the target's: draft id d is target id `m[d]` (m: [Vd] long,
or None for the identity), and the output-head rows a reduced readout keeps (`vocab=N`). Shared by
the heads (EAGLE-3, DFlash) and the drafted block."""

from __future__ import annotations

import torch

from ..models.layers import linear


def to_target_ids(m: torch.Tensor | None, draft_ids: torch.Tensor) -> torch.Tensor:
    """Draft-vocabulary ids -> target ids (same shape)."""
    return draft_ids if m is None else m[draft_ids.to(m.device)]


def to_target_logits(m: torch.Tensor | None, logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """[..., Vd] -> [..., V]: the draft logits at their target ids, -inf elsewhere (what vLLM does)."""
    if m is None:
        return logits
    full = logits.new_full((*logits.shape[:-1], vocab), float("-inf"))
    return full.index_copy_(-1, m.to(logits.device), logits)


def readout_rows(lm_head, ids: torch.Tensor, hidden_size: int, dtype: torch.dtype, device):
    """Rows `ids` ([m] long) of an output head: a float tensor's by index, a QuantLinear's read back
    exactly (its product with the identity) and quantized again in its kind. Both heads' `vocab=`
    (drafters/dflash_vocab.py, heads/eagle3_vocab.py)."""
    if isinstance(lm_head, torch.Tensor):
        return lm_head.index_select(0, ids)  # [m, H]
    eye = torch.eye(hidden_size, dtype=dtype, device=device)
    rows = linear(eye, lm_head).T.index_select(0, ids).contiguous()  # [m, H]
    return _requantize(rows, lm_head)


def _requantize(rows: torch.Tensor, like):
    """rows [m, H] in the quantization of `like` (a QuantLinear), by the same kernel choice."""
    from ..kernels import quant_linear
    from ..kernels.blocks import quantize

    kind = getattr(like, "kind", None)
    if kind is None or rows.shape[1] % 32:
        return rows
    blocks = quantize(rows, kind)
    return quant_linear.QuantLinear(blocks, rows.dtype, like.kernel if like.kernel in ("native", "blockwise")
                                    else quant_linear.choose_kernel(blocks))
