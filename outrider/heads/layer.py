"""The cached layer body every head kind runs once it has its queries and the keys and values its
rows attend to: attention, the output projection added to the residual, then the SwiGLU MLP on
its post-attention norm added back. EAGLE-3's layer (heads/eagle3/head.py: K/V written to the
head's cache, the slots' span read back) and each DFlash layer (heads/dflash/head.py: the cached
context's K/V with the block's own after it) end in it; the target's torch layers
(models/decoder.py) run the same arithmetic through their mixers, with the families' extras
(output gates, residual scales, experts)."""

from __future__ import annotations

import torch

from ..models.layers import attention, linear, rms_norm, swiglu_mlp


def attend_and_mlp(residual: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   mask: torch.Tensor | None, o, post_norm: torch.Tensor, gate_up, down, eps: float) -> torch.Tensor:
    """residual [B, T, H]; q [B, nh, T, D] (rotated); keys, values [B, G, L, D]; mask [B, 1, T, L]
    bool or None (every row) -> the layer's output [B, T, H]."""
    B, nh, T, D = q.shape
    out = attention(q, keys, values, mask)  # [B, nh, T, D]
    h = residual + linear(out.transpose(1, 2).reshape(B, T, nh * D), o)  # [B, T, H]
    return h + swiglu_mlp(rms_norm(h, post_norm, eps), gate_up, down)
