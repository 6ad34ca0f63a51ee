"""A reduced draft vocabulary's map to the target's: draft id d is target id `m[d]` (m: [Vd] long,
or None for the identity), and the output-head rows a reduced readout keeps (`vocab=N`). Shared by
the heads (EAGLE-3, DFlash) and the drafted block."""

from __future__ import annotations

import torch

from ..errors import ModelError
from ..models.layers import linear


def to_target_ids(m: torch.Tensor | None, draft_ids: torch.Tensor) -> torch.Tensor:
    """Draft-vocabulary ids -> target ids (same shape)."""
    return draft_ids if m is None else m[draft_ids.to(m.device)]


def to_draft_ids(m: torch.Tensor | None, target_ids: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target ids [n] -> (draft ids [n], kept [n] bool: the token is in the draft vocabulary; draft
    id 0 where it is not). The inverse of `to_target_ids`, for training labels."""
    if m is None:
        return target_ids, torch.ones_like(target_ids, dtype=torch.bool)
    inv = torch.full((vocab,), -1, dtype=torch.long)
    inv[m.cpu()] = torch.arange(m.numel())
    d = inv[target_ids.cpu()].to(target_ids.device)
    return d.clamp(min=0), d >= 0


def to_target_logits(m: torch.Tensor | None, logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """[..., Vd] -> [..., V]: the draft logits at their target ids, -inf elsewhere (what vLLM does)."""
    if m is None:
        return logits
    full = logits.new_full((*logits.shape[:-1], vocab), float("-inf"))
    return full.index_copy_(-1, m.to(logits.device), logits)


def readout_rows(lm_head, ids: torch.Tensor, hidden_size: int, dtype: torch.dtype, device):
    """Rows `ids` ([m] long) of an output head: a float tensor's by index, a QuantLinear's read back
    exactly (its product with the identity) and quantized again in its kind. Both heads' `vocab=`
    (drafters/dflash_vocab.py, heads/eagle3/vocab.py)."""
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


def draft_to_target(d2t: torch.Tensor, t2d: torch.Tensor, where: str = "the head") -> torch.Tensor:
    """The target id of each draft id ([Vd] long) from the stored maps, checked to invert:
    d + d2t[d] are distinct target ids, and t2d is true exactly on them."""
    if d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
        raise ModelError(f"EAGLE-3 head {where}: d2t must hold integers (int64 offsets), got {d2t.dtype}")
    vocab = t2d.shape[0]
    ids = torch.arange(d2t.shape[0]) + d2t.long()  # [Vd]
    if bool(((ids < 0) | (ids >= vocab)).any()) or torch.unique(ids).numel() != ids.numel():
        raise ModelError(f"EAGLE-3 head {where}: d2t maps draft ids outside the target vocabulary or two draft "
                         "ids to one target id; the vocab map is corrupt: re-export the head")
    keep = t2d.bool()
    if int(keep.sum()) != ids.numel() or not bool(keep[ids].all()):
        raise ModelError(f"EAGLE-3 head {where}: d2t and t2d do not invert each other (t2d marks "
                         f"{int(keep.sum())} tokens, d2t maps {ids.numel()}, not the same ones); "
                         "the vocab map is corrupt: re-export the head")
    return ids
