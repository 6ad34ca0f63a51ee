"""The gated-delta token mixer (Gated DeltaNet, as Qwen3.5 and Qwen3-Next use it), over a batch
of slots and their state (delta_state.py).

    h [B, T, E] -> in_proj -> (q k v | z | b | a) -> short causal conv (q k v) -> l2-normed q, k
    -> gated delta rule (gated_delta.py) -> RMS norm gated by silu(z) -> out_proj -> [B, T, E]

A slot's new tokens either continue its committed state as a plain prefill (no held rows, a causal
chain, no logits asked: folded at once, chunk by chunk) or are held rows of a tree (a verify, a
draft step, a decode step: TreeWY over the committed state and the rows already held, each node
seeing its ancestors as the batch's mask says, attention's rule). The convolution of a node reads
the inputs of its own path: the slot's last committed inputs, then its held and new ancestors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .config import DeltaConfig
from .gated_delta import chunked
from .layers import linear


@dataclass
class DeltaWeights:
    in_proj: torch.Tensor  # [conv_dim + HV dv + 2 HV, E]: q k v, then z, then b, then a
    conv: torch.Tensor  # [conv_dim, K] the depthwise convolution's taps, oldest input first
    a_neg: torch.Tensor  # [HV] float32: -exp(A_log)
    dt_bias: torch.Tensor  # [HV]
    norm: torch.Tensor  # [dv] the gated RMS norm's weight
    out: torch.Tensor  # [E, HV dv]


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def delta_mixer(w: DeltaWeights, cfg: DeltaConfig, h: torch.Tensor, batch, state, layer: int, eps: float,
                last_delta_layer: bool) -> torch.Tensor:
    """h [B, T, E] (normed) -> the mixer's output [B, T, E]; reads and writes `state.delta`."""
    B, T, E = h.shape
    HV, dv, C = cfg.num_v_heads, cfg.v_head_dim, cfg.conv_dim
    proj = linear(h, w.in_proj)  # [B, T, C + HV dv + 2 HV]
    x, z, b, a = proj.split([C, HV * dv, HV, HV], dim=-1)
    out = h.new_zeros(B, T, HV, dv)
    for i, slot in enumerate(batch.slot_ids):
        real = (batch.rows[i] != state.scratch_row) & (batch.rows[i] >= 0)
        n = int(real.sum())
        if n == 0:
            continue
        rows = batch.rows[i, :n].tolist()
        beta = torch.sigmoid(b[i, :n].float())  # [n, HV]
        g = w.a_neg * F.softplus(a[i, :n].float() + w.dt_bias)  # [n, HV]
        o = _slot(w, cfg, x[i, :n], g, beta, batch, i, slot, rows, state.delta, layer, last_delta_layer)
        out[i, :n] = o.to(h.dtype)
    normed = F.rms_norm(out.float(), (dv,), w.norm.float(), eps) * F.silu(z.view(B, T, HV, dv).float())
    return linear(normed.to(h.dtype).reshape(B, T, HV * dv), w.out)


def _slot(w, cfg, x, g, beta, batch, i, slot, rows, delta, layer, last_delta_layer) -> torch.Tensor:
    """One slot's n new tokens: x [n, C] the convolution's inputs -> o [n, HV, dv]."""
    n = len(rows)
    K = cfg.conv_kernel
    S = delta.S[layer][slot]
    history = delta.conv[layer][slot]  # [K - 1, C]
    held = delta.held[slot][layer]
    # what this forward may read: held rows below kv_len, but those written again now (new nodes)
    held_rows = [r for r in delta.held_rows(slot, layer) if r < batch.kv_len and r not in set(rows)]
    committed = delta.committed[slot]
    chain = rows == list(range(committed, committed + n)) and _causal(batch, i, rows)
    if chain and batch.fills_only:  # a plain prefill: fold as it goes
        inputs = torch.cat((history, x))  # [K - 1 + n, C]
        conv = F.silu(F.conv1d(inputs.T.unsqueeze(0), w.conv.unsqueeze(1), groups=inputs.shape[1])[0].T)  # [n, C]
        q, k, v = _qkv(conv, cfg)
        o, S_new = chunked(q, k, v, g, beta, S)
        delta.advance(slot, layer, S_new, inputs[inputs.shape[0] - (K - 1):], n, last_delta_layer)
        return o
    ancestors, held_ancestors = _ancestry(batch, i, rows, held_rows)
    held_x, stash = held.take(held_rows) if held_rows else (x.new_zeros(0, x.shape[1]), None)
    window = _windows(ancestors, held_ancestors, K)  # [n, K] into cat(history, held_x, x)
    inputs = torch.cat((history, held_x, x))
    conv = F.silu((inputs[window] * w.conv.T).sum(1))  # [n, C]
    q, k, v = _qkv(conv, cfg)
    o, new = delta.ops.tree_step(q, k, v, g, beta, S, ancestors, stash, held_ancestors)  # native or torch
    delta.hold(slot, layer, rows, x, new.k, new.u, new.gamma)
    return o


def _qkv(conv: torch.Tensor, cfg: DeltaConfig):
    """The convolution's output [n, C] -> q, k [n, HV, dk] (l2-normed, q scaled), v [n, HV, dv]."""
    n = conv.shape[0]
    HK, HV, dk, dv = cfg.num_k_heads, cfg.num_v_heads, cfg.k_head_dim, cfg.v_head_dim
    q, k, v = conv.split([HK * dk, HK * dk, HV * dv], dim=-1)
    q = l2_normalize(q.reshape(n, HK, dk).float()).repeat_interleave(HV // HK, dim=1) * dk ** -0.5
    k = l2_normalize(k.reshape(n, HK, dk).float()).repeat_interleave(HV // HK, dim=1)
    return q, k, v.reshape(n, HV, dv).float()


def _causal(batch, i: int, rows: list[int]) -> bool:
    """Whether batch entry i's new tokens see each other causally and every row before them."""
    if batch.attn_mask is None:
        return True
    mask = batch.attn_mask[i, 0, : len(rows)]  # [n, kv_len]
    first = rows[0]
    want = torch.ones_like(mask)
    want[:, first:] = False
    want[:, first: first + len(rows)] = torch.ones(len(rows), len(rows), dtype=torch.bool).tril()
    return bool(torch.equal(mask, want))


def _ancestry(batch, i: int, rows: list[int], held_rows: list[int]):
    """ancestors [n, n] (strict, among the new tokens), held_ancestors [n, P] (bool)."""
    n = len(rows)
    if batch.attn_mask is None:  # one slot, causal: everything before is on the path
        return (torch.ones(n, n, dtype=torch.bool).tril(-1),
                torch.ones(n, len(held_rows), dtype=torch.bool))
    mask = batch.attn_mask[i, 0, :n]  # [n, kv_len]
    index = torch.tensor(rows)
    ancestors = mask[:, index] & ~torch.eye(n, dtype=torch.bool)
    held = mask[:, torch.tensor(held_rows, dtype=torch.long)] if held_rows else torch.zeros(n, 0, dtype=torch.bool)
    return ancestors, held


def _windows(ancestors: torch.Tensor, held_ancestors: torch.Tensor, K: int) -> torch.Tensor:
    """Each node's last K convolution inputs along its path, oldest first, as indices into
    cat(history [K - 1], held [P], new [n]): long [n, K]."""
    n, P = held_ancestors.shape
    out = []
    for node in range(n):
        path = list(range(K - 1))  # the committed history (zeros before the first token)
        path += [K - 1 + j for j in range(P) if held_ancestors[node, j]]
        path += [K - 1 + P + j for j in range(node) if ancestors[node, j]]
        path.append(K - 1 + P + node)
        out.append(path[-K:])
    return torch.tensor(out, dtype=torch.long)
