"""`--drafter draftexpert[:FILE|NAME][,conf=C][,expand=N][,prefetch=off][,route=resident]`: DraftExpert (seed #26,
card 2.26), a fixed-footprint self-draft for a mixture-of-experts target.

The draft is the target's own layers with each MoE layer running its top-1 routed expert, the
shared expert and one small trained draft expert (models/draft_experts.py; trained by
train/draftexpert_train.py, self-distilled from the frozen target): per token and layer it reads
one routed expert where the target reads its top-k. FILE is a draft-expert safetensors file, NAME
a shipped one (models/shipped/draftexpert-NAME); with neither, the shipped file trained on this
target (the routers must match) is taken.

Like S2-MoE's self-draft (s2moe.py) it drafts over the target's own cache: the committed prefix's
K/V as the target wrote it, the draft's rows (the root and its drafts) past it, dropped before
verification (each slot's length set back to the committed prefix, where the verify forward
starts writing). Greedy output equals plain decoding token for token, whatever the draft.

Per round the drafter reads its own routing (RouterWatch): for every row it feeds, each MoE
layer's best k experts by the draft's router scores (k the target's top_k) are its prediction of
what the verify forward will route that token to.
- Prefetch: predicted (layer, expert) pairs not resident go to the target's expert store
  (models/expert_store.py) as a hint, read in the background while the draft goes on (off with
  `prefetch=off`; nothing to do when the experts are in memory).
- Expert-expansion truncation (`expand=N`, chains): the drafts' predicted pairs that are neither
  predicted for the root nor resident at the round's start are the experts drafting adds to the
  verify; once the fed drafts' pairs pass N no deeper draft is made. A draft's routing is known
  when it is fed, by the forward that also gives the next draft, so the draft in hand then is the
  last one kept (a stopping rule on drafts already made, as the entropy controller's: sampling
  stays exact).
- Confidence truncation (`conf=C`): no deeper draft once the path's draft probability falls
  below C (Budget.min_confidence, every tree shape).
- Resident routing (`route=resident`, under an expert store): the draft's top-1 expert chosen among
  the layer's resident experts only (the best overall where none is), so drafting reads nothing
  from the slow tier: a footprint fixed to what is in memory. Only the draft changes: still exact.
`rounds` keeps each round's figures (drafts, predicted and added pairs, stop reason) for benches.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..errors import ConfigError
from ..models.draft_experts import DraftExperts, DraftLayers, moe_layers, shipped, shipped_names
from .grow import Feed
from .model import ModelDrafter, ModelDraftState
from .registry import DrafterEntry, register

USAGE = "draftexpert[:FILE|NAME][,conf=C][,expand=N][,prefetch=off][,route=resident]"


@dataclass(frozen=True)
class DraftExpertArgs:
    file: str | None = None  # a draft-expert file or a shipped name; None: the shipped one for the target
    conf: float = 0.0  # confidence truncation: path probability floor (0: off)
    expand: int | None = None  # expert-expansion truncation: new target experts a round may add (None: off)
    prefetch: bool = True
    resident_routing: bool = False  # route=resident: the draft's top-1 among resident experts


def parse_argument(text: str) -> DraftExpertArgs:
    """"" -> defaults; "FILE,conf=0.3,expand=20,prefetch=off"."""
    args, file = {}, None
    for part in [p for p in text.split(",") if p] if text else []:
        key, eq, value = part.partition("=")
        try:
            if not eq and file is None and not args:
                file = part
            elif key == "conf" and 0.0 <= float(value) < 1.0:
                args["conf"] = float(value)
            elif key == "expand" and int(value) >= 0:
                args["expand"] = int(value)
            elif key == "prefetch" and value in ("on", "off"):
                args["prefetch"] = value == "on"
            elif key == "route" and value in ("top1", "resident"):
                args["resident_routing"] = value == "resident"
            else:
                raise ValueError
        except ValueError:
            raise ConfigError(f"{USAGE}: cannot read {part!r} (conf in [0, 1), expand >= 0, prefetch on|off, route top1|resident)") from None
    return DraftExpertArgs(file, **args)


def check_fits(argument: DraftExpertArgs, target_config, target_path: Path) -> str | None:
    moe = target_config.moe
    if moe is None or "moe" not in (target_config.mlp_kinds or ()):
        return "draftexpert drafts with the target's experts, and this target has no MoE layers (use early-exit:K)"
    if moe.top_k < 2:
        return "draftexpert drafts with the top-1 expert, and this target routes only 1 a token: nothing to save"
    return None


def experts_file(argument: DraftExpertArgs, target) -> DraftExperts:
    """The draft experts the argument names, checked against the target; with no name, the
    shipped set that fits it."""
    if argument.file is not None:
        path = Path(argument.file).expanduser()
        if not path.is_file() and argument.file in shipped_names():
            path = shipped(argument.file)
        if not path.is_file():
            raise ConfigError(f"draftexpert: no file {argument.file!r} and no shipped draft experts of that name "
                              f"(shipped: {', '.join(shipped_names()) or 'none'})")
        experts = DraftExperts.load(path)
        experts.check_fits(target)
        return experts
    for name in shipped_names():
        experts = DraftExperts.load(shipped(name))
        try:
            experts.check_fits(target)
            return experts
        except Exception:
            continue
    raise ConfigError("draftexpert: no shipped draft experts fit this target; train them "
                      "(python -m outrider.train.draftexpert_train --moe DIR --out FILE) and pass draftexpert:FILE")


class DraftExpertDrafter(ModelDrafter):
    """The target's layers with top-1 routing and a draft expert a layer; see the module's notes."""

    def __init__(self, target, shape, experts: DraftExperts, args: DraftExpertArgs = DraftExpertArgs(), *,
                 share_target_cache: bool = True, batched: bool = True):
        self.target, self.args, self.draft = target, args, DraftLayers(experts)
        decoder = copy.copy(target)  # the target's tensors, config and layers replaced at each round
        # torch layers (MoE layers never take the native one); a shape not measured yet is measured
        # at its first product (cpu_linear.matmul), so the routed experts (maybe in a store) are not walked
        decoder._native, decoder._linear_paths_chosen = None, True
        decoder.config = self.draft.config(target.config)
        decoder.layers = self.draft.layers(target, self._seen)
        name = "draftexpert" + (f":{args.file}" if args.file else "")
        super().__init__(decoder, shape, name=name, share_target_cache=share_target_cache, batched=batched)
        self.top_k = target.config.moe.top_k
        self.rounds: list[dict] = []  # each round's figures (bench reading)
        self._round = None

    # -- the draft's routing --------------------------------------------------------------------
    def _store(self):
        """The target's expert store when its routed experts live in one (else None)."""
        first = self.target.layers[moe_layers(self.target)[0]].moe.gate_up
        store = getattr(first, "store", None)
        return store if hasattr(store, "prefetch") else None

    def _seen(self, layer: int, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor | None:
        """RouterWatch's callback: the rows' predicted target experts at `layer` join the round;
        under route=resident, the logits the draft routes by (the non-resident experts' -inf)."""
        r = self._round
        if r is None:
            return None
        pairs = {(layer, int(e)) for e in torch.topk(logits.float(), self.top_k, dim=-1)[1].unique().tolist()}
        fresh = pairs - r["union"]
        r["union"] |= fresh
        if r["phase"] == "drafts":
            added = {p for p in fresh if p not in r["resident"]}
            r["added"] += len(added)
            r["predicted"] += len(fresh)
        if self.args.prefetch and r["store"] is not None:
            hint = [p for p in fresh if p not in r["resident"]]
            if hint:
                r["store"].prefetch(hint)
                r["hinted"] += len(hint)
        if self.args.resident_routing and r["store"] is not None:
            have = [e for (l, e) in r["store"].resident() if l == layer]
            if have:
                keep = torch.zeros(logits.shape[-1], dtype=torch.bool)
                keep[have] = True
                return logits.masked_fill(~keep, float("-inf"))  # [M, N]
        return None

    def _stop(self, inner):
        """Budget.stop for the chain: expansion truncation (and the budget's own rule)."""
        def stop(entropies: list[float]) -> bool:
            r = self._round
            if self.args.expand is not None and r["added"] > self.args.expand:
                r["stop"] = "expand"
                return True
            return inner(entropies) if inner is not None else False
        return stop

    # -- one round ------------------------------------------------------------------------------
    def propose_batch(self, seq_ids, tokens, budgets):
        store = self._store()
        self._round = {"phase": "root", "union": set(), "added": 0, "predicted": 0, "hinted": 0, "stop": None,
                       "store": store, "resident": set(store.resident()) if store is not None else set()}
        self.decoder.layers = self.draft.layers(self.target, self._seen)  # the target's current experts
        budgets = [replace(b, min_confidence=max(b.min_confidence, self.args.conf),
                           stop=self._stop(b.stop) if self.args.expand is not None else b.stop) for b in budgets]
        committed = {self._states[s].slot: len(t) - 1 for s, t in zip(seq_ids, tokens)} if self.target_cache is not None else {}
        try:
            trees = super().propose_batch(seq_ids, tokens, budgets)
        finally:
            self._roll_back(committed)
            r, self._round = self._round, None
        self.rounds.append({"drafts": sum(t.size - 1 for t in trees), "union": len(r["union"]),
                            "predicted": r["predicted"], "added": r["added"], "hinted": r["hinted"], "stop": r["stop"],
                            "pairs": frozenset(r["union"])})
        return trees

    def _forward(self, states: list[ModelDraftState], feeds: list[Feed]) -> list[torch.Tensor]:
        if self._round is not None:
            self._round["phase"] = "drafts"
        logits = super()._forward(states, feeds)
        self._hold(states, [st.base + f.first + len(f.tokens) for st, f in zip(states, feeds)])
        return logits

    def _catch_up(self, states: list[ModelDraftState], tokens: list[list[int]]) -> torch.Tensor:
        logits = super()._catch_up(states, tokens)
        self._hold(states, [st.base + 1 for st in states])  # the root's row
        return logits


def build(argument: DraftExpertArgs, shape, target, target_path: Path) -> DraftExpertDrafter:
    # a gated-delta target's state holds the verify's rows until the commit: a cache of its own there
    return DraftExpertDrafter(target, shape, experts_file(argument, target), argument,
                              share_target_cache=target.config.delta is None)


register(DrafterEntry("draftexpert", USAGE, replace(ModelDrafter.capabilities, reads_target_cache=True),
                      build=build, parse_argument=parse_argument, check_fits=check_fits))
