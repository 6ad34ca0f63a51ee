"""`--drafter s2moe:K'[,renorm]`: S2-MoE's self-drafter (expert skip), card 2.9 of the seed methods.

The MoE target drafts for itself: every layer of the target, every MoE layer routing each token
to its best K' experts of the same router scores instead of the model's K (K' < K; `renorm`
renormalises the K' weights to sum to 1 where the model does not renormalise its K; a model that
renormalises renormalises the K' too). Everything else is the target's: attention, shared
experts, dense layers, norms, lm_head.

Context-aligned: draft and target share one cache (the early-exit path of `ModelDrafter`,
model.py). The draft reads the committed prefix's K/V as the target (all K experts) wrote it, so
a draft's error does not pile up in the context; its own rows (the root and its drafts, every
layer) go past the sequence's committed prefix in the target's slot and are temporary: while it
drafts the slot's length covers them, and before the round's verification the length is set back
to the committed prefix (`_roll_back`), so the verify forward starts at the root's row and writes
the target's own K/V over every draft row it reads. Greedy output equals plain decoding, token for
token. A gated-delta target (Qwen3-Next) keeps a recurrent state the draft cannot write past and
roll back, so there the drafter keeps a cache of its own (the prompt prefilled once more, its
context drafted with K' experts: still exact, a lower acceptance).

Chains and every tree kind `ModelDrafter` grows (static, sampled, dynamic). `expand=R[,draft=C]`:
the routing-aware expansion (s2moe_expand.py): the drafted tree trimmed to the nodes whose path
confidence covers the new experts they would add to the verify (lossless: fewer nodes verified).
The lossy reuse-aware gating in verification is a verifier: spec/s2moe_gate.py.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch

from ..errors import ConfigError
from ..models.moe_layer import fewer_experts, selecting
from .grow import Feed
from .model import ModelDrafter, ModelDraftState
from .registry import DrafterEntry, register
from .s2moe_expand import RoutePredictor, node_experts, trim

USAGE = "s2moe:K'[,renorm][,expand=R[,draft=C]]"


def parse_argument(text: str) -> tuple[int, bool, float, float]:
    """"2" -> (2, False, 0.0, 0.0); "2,renorm" -> (2, True, 0.0, 0.0); "1,expand=0.02,draft=0.1" ->
    (1, False, 0.02, 0.1): the routing-aware expansion's R and C (s2moe_expand.py)."""
    head, *rest = text.split(",")
    try:
        k = int(head)
    except ValueError:
        k = 0
    renorm, expand, draft, ok = False, 0.0, 0.0, k >= 1
    for part in rest:
        key, eq, value = part.partition("=")
        try:
            if part == "renorm":
                renorm = True
            elif key in ("expand", "draft") and eq and float(value) >= 0.0:
                expand, draft = (float(value), draft) if key == "expand" else (expand, float(value))
            else:
                ok = False
        except ValueError:
            ok = False
    if not ok:
        raise ConfigError(f"{USAGE} needs the draft's experts per token K' >= 1, optionally ',renorm', and the "
                          "expansion's costs R, C >= 0")
    return k, renorm, expand, draft


def check_fits(argument: tuple[int, bool], target_config, target_path: Path) -> str | None:
    moe = target_config.moe
    if moe is None or "moe" not in (target_config.mlp_kinds or ()):
        return "s2moe drafts by routing fewer experts, and this target has no MoE layers (use early-exit:K)"
    if argument[0] >= moe.top_k:
        return (f"the target routes {moe.top_k} experts a token, so s2moe:K' needs K' below that "
                f"(1 to {moe.top_k - 1})")
    return None


class S2MoeDrafter(ModelDrafter):
    """The target with top-K' routing, over the target's own cache; see the module's notes."""

    def __init__(self, target, shape, top_k: int, renormalise: bool = False, expand: float = 0.0,
                 draft: float = 0.0, *, share_target_cache: bool = True, batched: bool = True):
        name = f"s2moe:{top_k}" + (",renorm" if renormalise else "") + (f",expand={expand:g}" if expand else "")
        super().__init__(target, shape, name=name, share_target_cache=share_target_cache, batched=batched)
        self.top_k, self.renormalise = top_k, renormalise
        self.expand, self.draft_cost = expand, draft  # routing-aware expansion (s2moe_expand.py); 0: off
        self._predictor = RoutePredictor() if expand or draft else None

    def propose_batch(self, seq_ids, tokens, budgets):
        trees = self._propose(seq_ids, tokens, budgets)
        if self._predictor is None:
            return trees
        found = self._predictor.experts
        self._predictor.experts = {}
        out = []
        for seq_id, tree in zip(seq_ids, trees):
            slot = self._states[seq_id].slot
            mine = {node: e for (key, node), e in found.items() if key == slot}
            out.append(trim(tree, node_experts(tree, mine), self.expand, self.draft_cost))
        return out

    def _propose(self, seq_ids, tokens, budgets):
        if self.target_cache is None:
            return super().propose_batch(seq_ids, tokens, budgets)
        committed = {self._states[s].slot: len(t) - 1 for s, t in zip(seq_ids, tokens)}  # the roots' rows
        try:
            return super().propose_batch(seq_ids, tokens, budgets)
        finally:
            self._roll_back(committed)

    @contextmanager
    def _predicting(self, rows: list):
        """The expansion's predictor reads this forward's routing (rows: (slot, node) or None each)."""
        if self._predictor is None:
            yield
            return
        self._predictor.rows = rows
        try:
            with selecting(self._predictor):
                yield
        finally:
            self._predictor.rows = None

    def _forward(self, states: list[ModelDraftState], feeds: list[Feed]) -> list[torch.Tensor]:
        T = max(len(f.tokens) for f in feeds)
        rows = [(st.slot, f.first + i) if i < len(f.tokens) else None for st, f in zip(states, feeds) for i in range(T)]
        with fewer_experts(self.top_k, self.renormalise), self._predicting(rows):
            logits = super()._forward(states, feeds)
        self._hold(states, [st.base + f.first + len(f.tokens) for st, f in zip(states, feeds)])
        return logits

    def _catch_up(self, states: list[ModelDraftState], tokens: list[list[int]]) -> torch.Tensor:
        n = [len(toks) - st.cached for st, toks in zip(states, tokens)]  # rows fed; the last is the root (node 0)
        rows = [(st.slot, 0) if i == k - 1 else None for st, k in zip(states, n) for i in range(max(n))]
        with fewer_experts(self.top_k, self.renormalise), self._predicting(rows):
            logits = super()._catch_up(states, tokens)
        self._hold(states, [st.base + 1 for st in states])  # the root's row
        return logits


def build(argument: tuple[int, bool], shape, target, target_path: Path) -> S2MoeDrafter:
    # a gated-delta target's state holds the verify's rows until the commit: a cache of its own there
    return S2MoeDrafter(target, shape, *argument, share_target_cache=target.config.delta is None)


register(DrafterEntry("s2moe", USAGE, replace(ModelDrafter.capabilities, reads_target_cache=True),
                      build=build, parse_argument=parse_argument, check_fits=check_fits))
