"""The EAGLE-3 head written as directly as possible from its spec: slow, no cache, no batch.

Only for tests: `Eagle3Head.forward` (batched, cached, tree masks) must agree with it. Each row
is computed from scratch with plain loops over heads and keys, in float64.
"""

from __future__ import annotations

import math

import torch

from .head import Eagle3Head


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x / torch.sqrt((x * x).mean() + eps))


def _rotate(x: torch.Tensor, position: int, theta: float) -> torch.Tensor:
    """x: [D] one head; Llama's RoPE, pairs (i, i + D/2) turned by position * theta^(-2i/D)."""
    D = x.shape[0]
    out = x.clone()
    for i in range(D // 2):
        angle = position * theta ** (-2 * i / D)
        a, b = x[i], x[i + D // 2]
        out[i] = a * math.cos(angle) - b * math.sin(angle)
        out[i + D // 2] = b * math.cos(angle) + a * math.sin(angle)
    return out


def reference_rows(head: Eagle3Head, features: list, tokens: list[int], first_position: int = 0):
    """Rows p = 0..T-1 at positions first_position + p, each seeing itself and the rows before.

    features[p]: [3, Ht] target features of row p, or None: the previous row's output hidden
    (a draft step). tokens[p]: the token of the next position, a target id.
    Returns (logits [T, V] over the target vocabulary, -inf outside the draft vocabulary;
    output hidden [T, H]), float64.
    """
    c, w = head.config, head.w
    f64 = lambda t: t.detach().to("cpu", torch.float64)  # noqa: E731
    eps, D = c.rms_norm_eps, c.head_dim
    fc, qkv, o = f64(w.fc), f64(w.qkv), f64(w.o)
    embed, lm_head = f64(_dense(w.embed)), f64(_dense(w.lm_head))
    gate, up = f64(w.gate_up).chunk(2)
    keys, values, logits, outs = [], [], [], []
    h_prev = None
    for p, (feature, token) in enumerate(zip(features, tokens)):
        pos = first_position + p
        f = h_prev if feature is None else fc @ f64(feature).reshape(-1)  # [H]
        e = embed[token]  # [H] (the target's embedding)
        x = torch.cat((_rms(e, f64(w.input_norm), eps), _rms(f, f64(w.hidden_norm), eps)))  # [2H]
        proj = qkv @ x
        q = proj[: c.num_heads * D].view(c.num_heads, D)
        k = proj[c.num_heads * D: (c.num_heads + c.num_kv_heads) * D].view(c.num_kv_heads, D)
        v = proj[(c.num_heads + c.num_kv_heads) * D:].view(c.num_kv_heads, D)
        keys.append(torch.stack([_rotate(k[g], pos, c.rope_theta) for g in range(c.num_kv_heads)]))
        values.append(v)
        heads = []
        for i in range(c.num_heads):
            g = i // (c.num_heads // c.num_kv_heads)  # grouped-query attention
            qi = _rotate(q[i], pos, c.rope_theta)
            scores = torch.stack([qi @ key[g] for key in keys]) / math.sqrt(D)
            weights = torch.softmax(scores, dim=0)
            heads.append(sum(wt * val[g] for wt, val in zip(weights, values)))
        residual = _rms(f, f64(w.hidden_norm), eps) if c.norm_before_residual else f
        h = residual + o @ torch.cat(heads)
        m = _rms(h, f64(w.post_norm), eps)
        h = h + f64(w.down) @ (torch.nn.functional.silu(gate @ m) * (up @ m))
        draft_logits = lm_head @ _rms(h, f64(w.norm), eps)  # [Vd]
        full = torch.full((c.vocab_size,), float("-inf"), dtype=torch.float64)
        ids = range(c.vocab_size) if w.draft_to_target is None else w.draft_to_target.tolist()
        for d, t in enumerate(ids):
            full[t] = draft_logits[d]
        logits.append(full)
        outs.append(h)
        h_prev = h
    return torch.stack(logits), torch.stack(outs)


def _dense(weight) -> torch.Tensor:
    if isinstance(weight, torch.Tensor):
        return weight
    raise TypeError("the reference forward takes float weights, not quantized ones")
