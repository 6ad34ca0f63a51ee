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

Chains and every tree kind `ModelDrafter` grows (static, sampled, dynamic). Not implemented here
(issue 41 item 4's later parts): the routing-aware expansion of the draft tree and the lossy
reuse-aware gating in verification.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from ..errors import ConfigError
from ..models.moe_layer import fewer_experts
from .grow import Feed
from .model import ModelDrafter, ModelDraftState
from .registry import DrafterEntry, register

USAGE = "s2moe:K'[,renorm]"


def parse_argument(text: str) -> tuple[int, bool]:
    """"2" -> (2, False); "2,renorm" -> (2, True)."""
    head, _, rest = text.partition(",")
    try:
        k = int(head)
    except ValueError:
        k = 0
    if k < 1 or rest not in ("", "renorm"):
        raise ConfigError(f"{USAGE} needs the draft's experts per token K' >= 1, optionally ',renorm'")
    return k, rest == "renorm"


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

    def __init__(self, target, shape, top_k: int, renormalise: bool = False, *, share_target_cache: bool = True,
                 batched: bool = True):
        name = f"s2moe:{top_k}" + (",renorm" if renormalise else "")
        super().__init__(target, shape, name=name, share_target_cache=share_target_cache, batched=batched)
        self.top_k, self.renormalise = top_k, renormalise

    def propose_batch(self, seq_ids, tokens, budgets):
        if self.target_cache is None:
            return super().propose_batch(seq_ids, tokens, budgets)
        committed = {self._states[s].slot: len(t) - 1 for s, t in zip(seq_ids, tokens)}  # the roots' rows
        try:
            return super().propose_batch(seq_ids, tokens, budgets)
        finally:
            self._roll_back(committed)

    def _roll_back(self, committed: dict[int, int]) -> None:
        """Drop the draft's rows before verification: each slot's length back to its committed
        prefix (the root's row), where the verify forward starts writing."""
        for slot, length in committed.items():
            self.target_cache.set_length(slot, length)

    def _hold(self, states: list[ModelDraftState], ends: list[int]) -> None:
        """Over the target's cache, the slots' lengths cover the rows the draft has written."""
        if self.target_cache is not None:
            for st, end in zip(states, ends):
                self.target_cache.set_length(st.slot, max(self.target_cache.lengths[st.slot], end))

    def _forward(self, states: list[ModelDraftState], feeds: list[Feed]) -> list[torch.Tensor]:
        with fewer_experts(self.top_k, self.renormalise):
            logits = super()._forward(states, feeds)
        self._hold(states, [st.base + f.first + len(f.tokens) for st, f in zip(states, feeds)])
        return logits

    def _catch_up(self, states: list[ModelDraftState], tokens: list[list[int]]) -> torch.Tensor:
        with fewer_experts(self.top_k, self.renormalise):
            logits = super()._catch_up(states, tokens)
        self._hold(states, [st.base + 1 for st in states])  # the root's row
        return logits


def build(argument: tuple[int, bool], shape, target, target_path: Path) -> S2MoeDrafter:
    # a gated-delta target's state holds the verify's rows until the commit: a cache of its own there
    return S2MoeDrafter(target, shape, *argument, share_target_cache=target.config.delta is None)


register(DrafterEntry("s2moe", USAGE, replace(ModelDrafter.capabilities, reads_target_cache=True),
                      build=build, parse_argument=parse_argument, check_fits=check_fits))
