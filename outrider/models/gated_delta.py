"""The gated delta rule (Gated DeltaNet's recurrence), its chunked WY form, and TreeWY: every node
of a draft tree from one triangular solve, from the committed state and a per-node stash.

Orientation (flash-linear-attention's, transformers' `torch_recurrent_gated_delta_rule`): per value
head, the state S is [dk, dv]; a token brings q, k (l2-normalised, q scaled by dk^-0.5), v, a
log-decay g <= 0 and a step size beta in (0, 1):

    S_t = e^{g_t} S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - e^{g_t} S_{t-1}^T k_t),   o_t = S_t^T q_t

Unrolled from a state S_0, with Gamma_i the sum of g along the path to i (i included):

    u_i = beta_i (v_i - e^{Gamma_i} S_0^T k_i - sum_{j strict ancestor of i} e^{Gamma_i - Gamma_j} (k_i . k_j) u_j)
    o_i = e^{Gamma_i} S_0^T q_i + sum_{j ancestor of i or i} e^{Gamma_i - Gamma_j} (q_i . k_j) u_j
    S_a = e^{Gamma_a} S_0 + sum_{j on the path to a} e^{Gamma_a - Gamma_j} k_j u_j^T

For a chain "ancestor" is "earlier"; for a tree (TreeWY, ../docs/methods.md) it is the ancestor
relation, and with nodes in topological order the first line is one unit lower-triangular solve
for every u at once. So a verify round keeps, per node, only (k, u, Gamma) (the **stash**:
HV (dk + dv + 1) values) instead of a [HV, dk, dv] state snapshot, and the accepted path's state is
rebuilt once at commit (`fold`). `snapshot_tree` is the per-node-snapshot baseline, and
`recurrent_reference` the plain per-token recurrence every form is tested against.

The state arithmetic runs in float64 (the state is small beside the projections): the sequential
step, the tree solve and the fold are the same algebra summed in different orders, and in float64
their differences stay far below float32's last bit, so a k-node verify and k one-token steps give
the float32 outputs the rest of the layer sees alike (tests/test_gated_delta.py).

Shapes: N nodes (or T tokens), P stash rows already held, HV value heads, dk, dv.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

STATE_DTYPE = torch.float64


@dataclass
class Stash:
    """Per node of a tree (or token of a chain) what the state needs: k [N, HV, dk], u [N, HV, dv]
    and gamma [N, HV] (the log-decay summed along the node's path from the committed state)."""

    k: torch.Tensor
    u: torch.Tensor
    gamma: torch.Tensor


def recurrent_reference(q, k, v, g, beta, state):
    """The per-token recurrence. q, k: [T, HV, dk]; v: [T, HV, dv]; g, beta: [T, HV]; state:
    [HV, dk, dv] -> (o [T, HV, dv], the state after the last token), in STATE_DTYPE."""
    q, k, v, g, beta, S = (t.to(STATE_DTYPE) for t in (q, k, v, g, beta, state))
    out = []
    for t in range(q.shape[0]):
        S = S * g[t].exp()[:, None, None]
        u = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", S, k[t]))  # [HV, dv]
        S = S + k[t][:, :, None] * u[:, None, :]
        out.append(torch.einsum("hkv,hk->hv", S, q[t]))
    return torch.stack(out), S


def tree_step(q, k, v, g, beta, state, ancestors, held: Stash | None = None, held_ancestors=None):
    """TreeWY: the outputs of N new nodes and their stash, in one triangular solve.

    q, k: [N, HV, dk]; v: [N, HV, dv]; g, beta: [N, HV] (float32 or float64); state: [HV, dk, dv]
    the committed state; ancestors: bool [N, N], ancestors[i, j] when j is a strict ancestor of i
    among the new nodes (topological order: j < i); held: the stash of P rows written by earlier
    calls on the same committed state, held_ancestors: bool [N, P] which of them are ancestors of
    each new node. Returns (o [N, HV, dv] STATE_DTYPE, the new nodes' Stash)."""
    q, k, v, g, beta = (t.to(STATE_DTYPE) for t in (q, k, v, g, beta))
    S = state.to(STATE_DTYPE)
    N = q.shape[0]
    eye = torch.eye(N, dtype=torch.bool, device=q.device)
    path = (ancestors | eye).to(STATE_DTYPE)  # [N, N] ancestors and self
    gamma = path @ g  # [N, HV]: the new part of each path
    if held is not None and held.k.shape[0]:
        # a held ancestor's gamma already sums the path up to it: the deepest one's is the prefix
        deepest = held_ancestors.any(-1, keepdim=True)  # [N, 1]
        gamma = gamma + torch.where(deepest, _deepest(held_ancestors, held.gamma), torch.zeros((), dtype=STATE_DTYPE))
    # [HV, N, ...] per head
    qh, kh, vh, bh, gh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), beta.T, gamma.T
    decay = (gh[:, :, None] - gh[:, None, :]).masked_fill(~ancestors[None], -torch.inf).exp()  # [HV, N, N]
    rhs = vh - gh.exp()[..., None] * torch.einsum("hkv,hnk->hnv", S, kh)  # [HV, N, dv]
    out = gh.exp()[..., None] * torch.einsum("hkv,hnk->hnv", S, qh)
    if held is not None and held.k.shape[0]:
        hk, hu, hg = held.k.to(STATE_DTYPE).transpose(0, 1), held.u.transpose(0, 1), held.gamma.T  # [HV, P, ...]
        old = (gh[:, :, None] - hg[:, None, :]).masked_fill(~held_ancestors[None], -torch.inf).exp()  # [HV, N, P]
        rhs = rhs - (old * (kh @ hk.transpose(1, 2))) @ hu
        out = out + (old * (qh @ hk.transpose(1, 2))) @ hu
    rhs = bh[..., None] * rhs
    A = bh[..., None] * decay * (kh @ kh.transpose(1, 2))  # [HV, N, N] strictly lower
    U = torch.linalg.solve_triangular(A + torch.eye(N, dtype=STATE_DTYPE), rhs, upper=False,
                                      unitriangular=True)  # [HV, N, dv]
    seen = (gh[:, :, None] - gh[:, None, :]).masked_fill(~(ancestors | eye)[None], -torch.inf).exp()
    out = out + (seen * (qh @ kh.transpose(1, 2))) @ U
    return out.transpose(0, 1), Stash(k=k, u=U.transpose(0, 1), gamma=gamma)


def _deepest(held_ancestors: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """held_ancestors: bool [N, P] (a chain of held rows per node), gamma: [P, HV] -> [N, HV]: the
    gamma of each node's deepest held ancestor (the one with the most held ancestors itself is the
    latest in topological order: the largest index)."""
    index = torch.where(held_ancestors, torch.arange(held_ancestors.shape[1]), -1).max(-1).values  # [N]
    return gamma[index.clamp(min=0)]


def fold(state: torch.Tensor, path: Stash) -> torch.Tensor:
    """The state after a path of stash rows (in order from the committed state): [HV, dk, dv]."""
    S = state.to(STATE_DTYPE)
    if path.k.shape[0] == 0:
        return S
    last = path.gamma[-1]  # [HV]
    weight = (last[None] - path.gamma).exp()  # [L, HV]
    update = torch.einsum("lh,lhk,lhv->hkv", weight, path.k.to(STATE_DTYPE), path.u)
    return last.exp()[:, None, None] * S + update


def chunked(q, k, v, g, beta, state, chunk: int = 64):
    """A chain of T tokens (a prompt) in chunks of the WY form: (o [T, HV, dv], final state)."""
    S = state.to(STATE_DTYPE)
    outs = []
    for start in range(0, q.shape[0], chunk):
        part = slice(start, start + chunk)
        n = q[part].shape[0]
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril(-1)
        o, stash = tree_step(q[part], k[part], v[part], g[part], beta[part], S, causal)
        outs.append(o)
        S = fold(S, stash)
    return torch.cat(outs), S


def snapshot_tree(q, k, v, g, beta, state, parents: list[int]):
    """The baseline TreeWY replaces: every node's own [HV, dk, dv] state, from its parent's
    (parents[i] == -1: the committed state). Returns (o [N, HV, dv], states [N, HV, dk, dv])."""
    q, k, v, g, beta = (t.to(STATE_DTYPE) for t in (q, k, v, g, beta))
    S0 = state.to(STATE_DTYPE)
    states, outs = [], []
    for i, p in enumerate(parents):
        S = (S0 if p < 0 else states[p]) * g[i].exp()[:, None, None]
        u = beta[i][:, None] * (v[i] - torch.einsum("hkv,hk->hv", S, k[i]))
        S = S + k[i][:, :, None] * u[:, None, :]
        states.append(S)
        outs.append(torch.einsum("hkv,hk->hv", S, q[i]))
    return torch.stack(outs), torch.stack(states)
