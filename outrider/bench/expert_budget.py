"""`outrider bench --expert-budget FRACTION[,store=mmap|direct]`: every method of the run under the
same resident budget of a mixture of experts' routed experts, with the bytes each moves.

    budget = ExpertBudget.parse("0.25,store=direct")    # ConfigError (one line) on bad text
    tier = BudgetTier(budget, target, folder)           # ConfigError where the target cannot
    r = tier.run(lambda: run_ours(...))                 # r.stats gains expert_bytes, expert_misses ...

A run takes a fresh store (models/expert_store.py; cold, as scripts/bench_draftexpert.py's tiers):
an LRU set of round(FRACTION x layers x experts) experts (at least 1), the rest read from the
model's safetensors on demand, `store=mmap` (the default) through the page cache, `store=direct`
with O_DIRECT past it (models/slow_tier.py DirectStore). The target's MoE layers read their
routed experts through it (moe_layer's seam, store.layer(l)) for the run, then get their own back.

What a run records (runner.aggregate sums them into `expert_mb_per_token`, the table's MB/tok):
expert_bytes (read during the whole request), expert_prefill_bytes (what the prompt's prefill
alone reads from a cold store: measured once a prompt with one new token, the same reads for every
method, since the prefill routes alike whichever method follows), expert_misses, expert_stall_s.
Bytes per committed token are (expert_bytes - expert_prefill_bytes) / new tokens: the decode's
traffic, AR's and each method's alike.

Refused in one line: a target without MoE layers, a quantized target (the store reads the float
tensors of the safetensors files, so the budgeted model would not be the quantized one: run
--dtype float32), a folder without safetensors (an imported GGUF), and, in the bench, peers (their
own models run outside the store).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ConfigError

STORES = ("mmap", "direct")
_TEXT = re.compile(r"(?P<share>[0-9.eE+-]+)(?:,store=(?P<store>[a-z]+))?")


@dataclass(frozen=True)
class ExpertBudget:
    share: float  # of all routed experts (layers x experts), resident at once
    store: str = "mmap"  # STORES: misses from the page cache, or with O_DIRECT

    @classmethod
    def parse(cls, text) -> "ExpertBudget":
        match = _TEXT.fullmatch(str(text).strip())
        try:
            share = float(match.group("share")) if match else None
        except ValueError:
            share = None
        store = (match.group("store") if match else None) or "mmap"
        if share is None or not 0 < share <= 1 or store not in STORES:
            raise ConfigError(f"--expert-budget {text!r}: give FRACTION[,store=mmap|direct], FRACTION in (0, 1] "
                              "(the share of all routed experts resident at once), e.g. 0.25,store=direct")
        return cls(share, store)

    def __str__(self) -> str:
        return f"{self.share:g},store={self.store}"


class BudgetTier:
    """The routed experts of `target` (loaded from `folder`) behind a fresh store a run."""

    def __init__(self, budget: ExpertBudget, target, folder: Path):
        from ..models.draft_experts import moe_layers

        self.budget, self.target = budget, target
        self.layers = moe_layers(target)
        if not self.layers:
            raise ConfigError(f"--expert-budget: {folder.name} has no mixture-of-experts layers to budget")
        moe = target.layers[self.layers[0]].moe
        if not all(isinstance(w, torch.Tensor) for l in self.layers for w in target.layers[l].moe.gate_up):
            raise ConfigError(f"--expert-budget: {folder.name}'s experts are quantized; the store reads the float "
                              "experts of its safetensors, so run the budget with --dtype float32")
        self.files = sorted(Path(folder).glob("*.safetensors"))
        if not self.files:
            raise ConfigError(f"--expert-budget: {folder} keeps no safetensors (an imported GGUF?): the store reads "
                              "a safetensors checkpoint's experts")
        self.count = len(target.layers) * len(moe.gate_up)  # the store's index space: every layer x experts
        self.experts = len(moe.gate_up)
        self.slots = max(1, round(budget.share * len(self.layers) * self.experts))
        self.dtype = moe.gate_up[0].dtype
        self.prefill_bytes: dict = {}  # prompt key -> bytes its prefill reads from a cold store

    def _store(self):
        from ..models.expert_store import ExpertStore
        from ..models.slow_tier import DirectStore

        kind = DirectStore if self.budget.store == "direct" else ExpertStore
        return kind(self.files, len(self.target.layers), self.experts, self.slots, self.dtype)

    def run(self, fn):
        """fn() (a PromptRun) with the experts behind a fresh store; its stats gain the store's."""
        store = self._store()
        saved = [(l, self.target.layers[l].moe.gate_up, self.target.layers[l].moe.down) for l in self.layers]
        try:
            for l in self.layers:
                moe = self.target.layers[l].moe
                moe.gate_up, moe.down = store.layer(l)
            r = fn()
        finally:
            for l, gate_up, down in saved:
                self.target.layers[l].moe.gate_up, self.target.layers[l].moe.down = gate_up, down
            store.wait()
            stats = store.stats.as_dict()
            store.close()
        r.stats.update(expert_bytes=stats["bytes_read"], expert_misses=stats["misses"],
                       expert_stall_s=stats["stall_s"], expert_read_s=stats["read_s"])
        return r

    def prefill(self, key, fn) -> int:
        """The bytes a prompt's prefill reads from a cold store (fn: the request with one new
        token), measured once a `key`."""
        if key not in self.prefill_bytes:
            self.prefill_bytes[key] = self.run(fn).stats["expert_bytes"]
        return self.prefill_bytes[key]


def mb_per_token(runs) -> float | None:
    """MiB the decode read per output token over runs (PromptRun), None where none was budgeted."""
    if not runs or not all("expert_bytes" in r.stats for r in runs):
        return None
    moved = sum(r.stats["expert_bytes"] - r.stats.get("expert_prefill_bytes", 0) for r in runs)
    return moved / 2**20 / max(sum(len(r.output_ids) for r in runs), 1)
