"""The MTP head written as directly as possible from its spec (heads/mtp/head.py): slow, no cache.

Only for tests: `MtpHead.forward` must agree with it. Each row from scratch, plain loops over
heads and keys, float64.
"""

from __future__ import annotations

import math

import torch

from .head import MtpHead


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * weight / (x.pow(2).mean() + eps).sqrt()


def _turn(x: torch.Tensor, position: int, theta: float) -> torch.Tensor:
    """Llama's RoPE on one head x [D]: the pair (x_i, x_{i+D/2}) as a complex number times
    exp(1j * position * theta^(-2i/D))."""
    half = x.shape[0] // 2
    pairs = torch.complex(x[:half], x[half:])
    angles = torch.tensor([position * theta ** (-2 * i / x.shape[0]) for i in range(half)], dtype=torch.float64)
    turned = pairs * torch.polar(torch.ones_like(angles), angles)
    return torch.cat((turned.real, turned.imag))


def _plain(weight) -> torch.Tensor:
    if not isinstance(weight, torch.Tensor):
        raise TypeError("the reference forward takes float weights, not quantized ones")
    return weight


def reference_rows(head: MtpHead, features: list, tokens: list[int], first_position: int = 0):
    """Rows p = 0..T-1 at positions first_position + p, each seeing itself and the rows before.

    features[p]: [H] the target's last-layer hidden of row p, or None: the previous row's output
    hidden (a draft step); tokens[p]: the token of the next position. Returns (logits [T, V],
    output hidden [T, H]), float64."""
    c, w = head.config, head.w
    f64 = lambda t: t.detach().to("cpu", torch.float64)  # noqa: E731
    eps, D = c.rms_norm_eps, c.head_dim
    eh, qkv, o = f64(w.eh_proj), f64(w.qkv), f64(w.o)
    embed, lm_head = f64(_plain(w.embed)), f64(_plain(w.lm_head))
    gate, up = f64(w.gate_up).chunk(2)
    keys, values, logits, outs = [], [], [], []
    h_prev = None
    for p, (feature, token) in enumerate(zip(features, tokens)):
        pos = first_position + p
        f = h_prev if feature is None else f64(feature).reshape(-1)  # [H]
        e = embed[token] * (0.0 if pos == 0 else 1.0)
        x0 = eh @ torch.cat((_norm(e, f64(w.enorm), eps), _norm(f, f64(w.hnorm), eps)))  # [H]
        proj = qkv @ _norm(x0, f64(w.input_norm), eps)
        q = proj[: c.num_heads * D].view(c.num_heads, D)
        k = proj[c.num_heads * D: (c.num_heads + c.num_kv_heads) * D].view(c.num_kv_heads, D)
        v = proj[(c.num_heads + c.num_kv_heads) * D:].view(c.num_kv_heads, D)
        keys.append(torch.stack([_turn(k[g], pos, c.rope_theta) for g in range(c.num_kv_heads)]))
        values.append(v)
        heads = []
        for i in range(c.num_heads):
            g = i // (c.num_heads // c.num_kv_heads)
            qi = _turn(q[i], pos, c.rope_theta)
            weights = torch.softmax(torch.stack([qi @ key[g] for key in keys]) / math.sqrt(D), dim=0)
            heads.append(sum(wt * val[g] for wt, val in zip(weights, values)))
        h = x0 + o @ torch.cat(heads)
        m = _norm(h, f64(w.post_norm), eps)
        h = h + f64(w.down) @ (torch.nn.functional.silu(gate @ m) * (up @ m))
        logits.append(lm_head @ _norm(h, f64(w.norm), eps))
        outs.append(h)
        h_prev = h
    return torch.stack(logits), torch.stack(outs)
