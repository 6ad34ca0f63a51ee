"""A decoder layer with norms on both sides of each sub-block (Gemma 3's "sandwich"), in torch ops:

    x = x + norm_attn_out(attention(norm_in(x)))
    x = x + norm_mlp_out(mlp(norm_mlp_in(x)))

where Llama's block adds the attention's and the MLP's outputs unnormed. The attention is the
usual mixer (attention_layer.py: Q/K norms, the family's scale) with the layer's own RoPE tables
and mask (a sliding-window layer's: models/sliding.py); the MLP is gated, SiLU or GELU-tanh
(layers.gated_mlp). Weights: LayerWeights' input_norm, attn_out_norm, post_norm (the MLP's input
norm, `pre_feedforward_layernorm`), mlp_out_norm (`post_feedforward_layernorm`).
"""

from __future__ import annotations

import torch

from .attention_layer import SpanView, attention_mixer
from .layers import gated_mlp, rms_norm


def sandwich_layer(w, c, x: torch.Tensor, batch, cache, index: int, cos: torch.Tensor, sin: torch.Tensor,
                   view: SpanView) -> torch.Tensor:
    """x [B, T, E] -> x after layer `index` [B, T, E]; writes the layer's K/V rows."""
    eps = c.rms_norm_eps
    attended = attention_mixer(w, c, rms_norm(x, w.input_norm, eps), batch, cache, index, cos, sin, view)
    x = x + rms_norm(attended, w.attn_out_norm, eps)
    mlp = gated_mlp(rms_norm(x, w.post_norm, eps), w.gate_up, w.down, c.activation)
    return x + rms_norm(mlp, w.mlp_out_norm, eps)
