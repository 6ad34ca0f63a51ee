"""The DFlash head's forward written out plainly: one sequence, the whole context every time.

The slow reference `DFlashHead.block` (cached context, slots, masks) is tested against
(tests/test_dflash_head.py). It follows heads/dflash/head.py's docstring line by line, with plain
matrix products and an explicit softmax, and no K/V cache.
"""

from __future__ import annotations

import torch

from .head import DFlashHead


def _rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x: [heads, T, D], positions [T] -> rotated (half-split layout)."""
    angles = positions.float().unsqueeze(-1) * inv_freq  # [T, D/2]
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _dense(w) -> torch.Tensor:
    return w if isinstance(w, torch.Tensor) else w.dequantize()


@torch.no_grad()
def reference_block(head: DFlashHead, features: torch.Tensor, tokens: torch.Tensor, first: int = 1) -> torch.Tensor:
    """features: [n, taps, Ht] of positions 0..n-1 (the context); tokens: [B] the block at
    positions n .. n+B-1 -> logits [B-first, Vd] float32 of slots first..B-1 (DSpark: first=0)."""
    c, w = head.config, head.w
    eps, nh, G, D = c.rms_norm_eps, c.num_heads, c.num_kv_heads, c.head_dim
    n, B = features.shape[0], tokens.shape[0]
    ctx = _norm(features.flatten(1).float() @ _dense(w.fc).float().T, w.hidden_norm.float(), eps)  # [n, H]
    table = _dense(w.embed).float()
    h = table[tokens]  # [B, H]
    pos_ctx, pos_blk = torch.arange(n), torch.arange(n, n + B)
    for layer in w.layers:
        x = _norm(h, layer.input_norm.float(), eps)
        q = _norm((x @ _dense(layer.q).float().T).view(B, nh, D), layer.q_norm.float(), eps).transpose(0, 1)
        both = torch.cat((ctx, x))  # [n + B, H]: the context injected beside the block
        k = _norm((both @ _dense(layer.k).float().T).view(n + B, G, D), layer.k_norm.float(), eps).transpose(0, 1)
        v = (both @ _dense(layer.v).float().T).view(n + B, G, D).transpose(0, 1)  # [G, n + B, D]
        positions = torch.cat((pos_ctx, pos_blk))
        q, k = _rope(q, pos_blk, head.inv_freq), _rope(k, positions, head.inv_freq)
        k, v = k.repeat_interleave(nh // G, 0), v.repeat_interleave(nh // G, 0)  # [nh, n + B, D]
        weights = torch.softmax(q @ k.transpose(1, 2) / D**0.5, dim=-1)  # [nh, B, n + B]: no causal mask
        out = (weights @ v).transpose(0, 1).reshape(B, nh * D)
        h = h + out @ _dense(layer.o).float().T
        gate, up = (_norm(h, layer.post_norm.float(), eps) @ _dense(layer.gate_up).float().T).chunk(2, -1)
        h = h + (torch.nn.functional.silu(gate) * up) @ _dense(layer.down).float().T
    return _norm(h[first:], w.norm.float(), eps) @ _dense(w.lm_head).float().T
