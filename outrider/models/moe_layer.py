"""The mixture-of-experts MLP (the sparse block of Qwen2-MoE, Qwen3-MoE, Qwen3-Next), in plain torch:
the reference every faster path (issue 41: experts in the native quantized kernels) is held to.

    x [M, E] -> router logits [M, N] -> softmax -> top k -> (renormalised) weights [M, k]
    out[m] = sum over m's chosen experts e of weight(m, e) * SwiGLU_e(x[m])
             + sigmoid(x[m] . shared_gate) * SwiGLU_shared(x[m])            (Qwen's shared expert)

DeepSeek's routers are switches of the same route (MoeConfig's fields, deepseek_moe.py): V2's
softmax chosen greedily or group-limited (each row's best topk_group of n_group groups, a group
scored by its best expert), V3's sigmoid chosen with e_score_correction_bias added (for choosing
only: the weights are the unbiased scores) among the groups scored by their best two experts'
sum, renormalised when norm_topk_prob, then times routed_scaling_factor; their shared experts are
ungated (out += SwiGLU_shared(x[m])).

Shapes: M rows (a forward's B * T tokens), E hidden size, N routed experts, k chosen per row,
I the expert size. The experts run one at a time on the rows that chose them (gathered, multiplied,
scattered back weighted), in expert order: a verify of many rows reads each chosen expert once.
Which rows chose which expert is read to the host once a layer (the count per expert): the
gathers need their sizes. `moe_mlp_per_token` is the slow reference beside it: every row's every
choice multiplied alone (a k-token verify reads a chosen expert once per row that chose it);
tests/test_moe_grouping.py holds the grouped product to it.

Expert skip (S2-MoE's self-drafter, drafters/s2moe.py): inside `fewer_experts(k', renormalise)`
every MoE layer routed in this thread (or task) chooses k' < k experts per row of the same router
scores, renormalised over the k' where the model renormalises or `renormalise` asks.

Expert selection (LOSSY, the verify-side selections: spec/acceptmoe.py, models/edgexpert.py):
inside `selecting(selection)` moe_mlp routes its rows by `selection.route(w, cfg, flat)`, which
calls route() with `allowed` [M, N] bool, each row choosing its k among its allowed experts only
(models/expert_select.py). Outside it (every forward by default) routing is route()'s, exactly.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from .layers import linear, swiglu_mlp
from .moe_config import MoeConfig


@dataclass
class MoeWeights:
    router: torch.Tensor  # [N, E] float: the router's logits are x . router[e]
    gate_up: list  # N x [2I, E]: each expert's gate rows then up rows (a float tensor or a QuantLinear)
    down: list  # N x [E, I]
    shared_gate_up: object | None = None  # [2I_s, E]: the shared expert (None: no shared expert)
    shared_down: object | None = None  # [E, I_s]
    shared_gate: torch.Tensor | None = None  # [1, E]: the shared expert's output times sigmoid(x . w)
    score_bias: torch.Tensor | None = None  # [N] float32: added to the scores for choosing only (DeepSeek-V3)

    @property
    def matrices(self) -> list:
        """Its projection weights (what the CPU product paths are measured on)."""
        shared = [m for m in (self.shared_gate_up, self.shared_down, self.shared_gate) if m is not None]
        return [self.router, *self.gate_up, *self.down, *shared]


_SKIP: ContextVar[tuple[int, bool] | None] = ContextVar("outrider_expert_skip", default=None)
_SELECT: ContextVar[object | None] = ContextVar("outrider_expert_select", default=None)


@contextmanager
def selecting(selection):
    """Within it, moe_mlp routes by `selection.route(w, cfg, flat) -> (weights [M, k], experts [M, k])`
    (an expert_select.Selection: LOSSY routing restricted to eligible sets, and its counters)."""
    token = _SELECT.set(selection)
    try:
        yield
    finally:
        _SELECT.reset(token)


@contextmanager
def fewer_experts(top_k: int, renormalise: bool = False):
    """Within it, route() chooses top_k experts a row instead of the config's (top_k must not be
    more), renormalised over them when `renormalise` or the config's norm_topk_prob."""
    token = _SKIP.set((top_k, renormalise))
    try:
        yield
    finally:
        _SKIP.reset(token)


def row_exact_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, in], weight [out, in] -> [M, out], each row by its own one-row product: a row's bits
    do not depend on how many rows came with it (a BLAS product's do: its path and blocking change
    with M), so a k-token verify routes each row as a one-token decode step would. The float
    router of a model whose experts are kept quantized (exact) is multiplied so."""
    if x.shape[0] <= 1:
        return linear(x, weight)
    return torch.cat([linear(x[m: m + 1], weight) for m in range(x.shape[0])])  # [M, out]


def router_scores(x: torch.Tensor, router: torch.Tensor, cfg: MoeConfig, exact: bool = False) -> torch.Tensor:
    """x [M, E] -> [M, N] float32: each row's router scores (softmax or sigmoid of its logits), as
    route() has them; `exact`: the logits row by row (row_exact_linear)."""
    product = row_exact_linear if exact else linear
    logits = product(x.float(), router.float()) if cfg.router_float32 else product(x, router)  # [M, N]
    if cfg.scoring == "softmax":
        return torch.softmax(logits, dim=-1, dtype=torch.float32)
    return torch.sigmoid(logits.float())


def route(x: torch.Tensor, router: torch.Tensor, cfg: MoeConfig,
          score_bias: torch.Tensor | None = None, allowed: torch.Tensor | None = None, exact: bool = False
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, E] -> (weights [M, k] in x's dtype, float32 where cfg.weights_float32; experts [M, k]
    long): each row's k experts of the
    best scores (softmax or sigmoid of the router's logits, in float32; plus score_bias [N] for
    choosing, within the row's best groups where cfg.n_group > 1), weighted by their unbiased
    scores, renormalised over the k when cfg.norm_topk_prob, times cfg.routed_scale. `allowed`
    [M, N] bool (LOSSY expert selection): each row chooses among its allowed experts only (each
    row must allow at least k). `exact`: the router's logits row by row (row_exact_linear)."""
    scores = router_scores(x, router, cfg, exact)  # [M, N]
    choice = scores if score_bias is None else scores + score_bias  # [M, N]
    if cfg.n_group > 1:
        choice = _within_best_groups(choice, cfg)
    if allowed is not None:
        choice = choice.masked_fill(~allowed, float("-inf"))
    skip = _SKIP.get()  # (k', renormalise) under fewer_experts: S2-MoE's draft
    top_k, renormalise = (cfg.top_k, False) if skip is None else (min(skip[0], cfg.top_k), skip[1])
    experts = torch.topk(choice, top_k, dim=-1)[1]  # [M, k]
    top = _chosen_weights(scores, choice, experts)  # [M, k]
    if cfg.norm_topk_prob or renormalise:  # DeepSeek-V3 adds 1e-20 to the sum (transformers' arithmetic, kept)
        top = top / (top.sum(dim=-1, keepdim=True) + (1e-20 if cfg.scoring == "sigmoid" else 0.0))
    if cfg.routed_scale != 1.0:
        top = top * cfg.routed_scale
    return (top if cfg.weights_float32 else top.to(x.dtype)), experts


def _within_best_groups(choice: torch.Tensor, cfg: MoeConfig) -> torch.Tensor:
    """choice [M, N] -> the same with every expert outside the row's best topk_group groups masked
    (0 for softmax scores, as transformers' V2 does; -inf for V3's biased sigmoid scores)."""
    M, N = choice.shape
    grouped = choice.view(M, cfg.n_group, N // cfg.n_group)  # [M, G, N / G]
    if cfg.group_score == "max":
        group = grouped.max(dim=-1).values  # [M, G]
    else:
        group = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [M, G]
    best = torch.topk(group, cfg.topk_group, dim=-1)[1]  # [M, topk_group]
    keep = torch.zeros_like(group, dtype=torch.bool).scatter_(1, best, True)  # [M, G]
    keep = keep.unsqueeze(-1).expand(M, cfg.n_group, N // cfg.n_group).reshape(M, N)
    return choice.masked_fill(~keep, 0.0 if cfg.scoring == "softmax" else float("-inf"))


def _chosen_weights(scores: torch.Tensor, choice: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """scores, choice [M, N], experts [M, k] -> [M, k]: the chosen experts' weights, from the scores
    (never from choice, which may carry the choosing bias)."""
    return scores.gather(1, experts)


def moe_mlp(w: MoeWeights, cfg: MoeConfig, x: torch.Tensor) -> torch.Tensor:
    """x [B, T, E] (normed) -> the MoE MLP's output [B, T, E]."""
    flat = x.reshape(-1, x.shape[-1])  # [M, E]
    weights, experts = _routed(w, cfg, flat)  # [M, k], [M, k]
    k = experts.shape[1]
    chosen = experts.reshape(-1)  # [M k]: row m's j-th choice at m * k + j
    order = torch.argsort(chosen, stable=True)  # [M k]: the choices grouped by expert, rows ascending
    rows = order // k  # [M k]: the row of each grouped choice
    scale = weights.reshape(-1).index_select(0, order)  # [M k]
    counts = torch.bincount(chosen, minlength=cfg.num_experts).tolist()  # the layer's one host read
    out = torch.zeros_like(flat)  # [M, E]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        at = rows[start: start + n]  # [n] the rows that chose expert e
        y = swiglu_mlp(flat.index_select(0, at), w.gate_up[e], w.down[e])  # [n, E]
        out.index_add_(0, at, (y * scale[start: start + n, None]).to(out.dtype))  # float32 weights: rounded here
        start += n
    return _with_shared(w, flat, out).reshape(x.shape)


def moe_mlp_per_token(w: MoeWeights, cfg: MoeConfig, x: torch.Tensor) -> torch.Tensor:
    """The slow reference of moe_mlp: x [B, T, E] -> [B, T, E], each row's k chosen experts run on
    that row alone, one at a time, and summed weighted (the same route)."""
    flat = x.reshape(-1, x.shape[-1])  # [M, E]
    weights, experts = _routed(w, cfg, flat)  # [M, k], [M, k]
    out = torch.zeros_like(flat)  # [M, E]
    for m, (row_weights, row_experts) in enumerate(zip(weights, experts.tolist())):
        for weight, e in zip(row_weights, row_experts):
            out[m] += (swiglu_mlp(flat[m: m + 1], w.gate_up[e], w.down[e])[0] * weight).to(out.dtype)
    return _with_shared(w, flat, out).reshape(x.shape)


def _routed(w: MoeWeights, cfg: MoeConfig, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """route() of flat [M, E]'s rows, or the selection's inside `selecting` (LOSSY)."""
    selection = _SELECT.get()
    if selection is None:
        return route(flat, w.router, cfg, w.score_bias, exact=_experts_exact(w))
    return selection.route(w, cfg, flat)


def _experts_exact(w: MoeWeights) -> bool:
    """Whether the experts are kept quantized (QuantLinear: each row's product bit-identical however
    many rows are multiplied), so the float router and shared gate must be row-exact too. Experts
    behind an expert store (a LayerExperts, float) are not looked at: reading one counts a use."""
    return isinstance(w.gate_up, list) and not isinstance(w.gate_up[0], torch.Tensor)


def _with_shared(w: MoeWeights, flat: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out [M, E] plus the shared expert's output on flat [M, E] (gated where it has a gate)."""
    if w.shared_gate_up is not None:
        shared = swiglu_mlp(flat, w.shared_gate_up, w.shared_down)  # [M, E]
        if w.shared_gate is not None:
            gate = (row_exact_linear if _experts_exact(w) else linear)(flat, w.shared_gate)  # [M, 1]
            shared = torch.sigmoid(gate) * shared  # [M, 1] * [M, E]
        out = out + shared
    return out
