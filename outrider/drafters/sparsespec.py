"""`--drafter sparsespec[:BUDGET[,SINK[,RECENT]]]`: SparseSpec-L, self-speculation over a sparse,
recallable K/V cache (issue 26, item 3).

Zhao, Tang, Zhu et al., "Accelerating Large-Scale Reasoning Model Inference with Sparse
Self-Speculative Decoding", arXiv 2512.01278 (2025): the target drafts for itself with every
layer, but each draft forward attends only to the keys that mattered to the last full
(verification) forward - their PillarAttn - while verification attends to everything.

Here, each round:

1. Selection. The verify forward taps the hidden state entering every layer at the rows of the
   root and the accepted drafts (`needs_hidden`: no extra target pass; the prefill's taps give
   the first round the prompt's last rows). For layer l, those rows' queries are recomputed
   (norm, q projection, rotary at their positions: a few rows) and scored against layer l's keys
   over the committed prefix; softmax per query head, summed over the rows and over the query
   heads that share a K/V head. Per layer and per K/V head, the kept keys are the SINK first
   positions, the RECENT last ones and the best of the rest by that mass, BUDGET in all (every
   key when the prefix holds no more than BUDGET). Different layers and K/V heads keep
   different positions. The selection is made afresh every round from the dense cache, which is
   never pruned, so a key dropped one round comes back the next when it matters again.
2. Gather. The kept rows are copied from the target's cache (read only) into a small cache of
   the drafter's own: row r of layer l, K/V head g holds that head's r-th kept position. K rows
   were rotated at their true positions when the target wrote them, and attention does not care
   where a key sits, so queries at their true positions (`pack(shifts=...)`: rows past the
   kept ones are positions base + depth) see exactly the kept keys. The root and the drafts are
   written past the kept rows of the drafter's cache: the target's cache is never written.
3. Draft. ModelDrafter's growers (chain, static, sampled, dynamic trees) with the target's
   every layer over that cache: the catch-up forward (the root) gives the first draft, one
   forward per further depth. Each reads BUDGET keys a layer instead of the whole context.

The target verifies every draft with full attention, so the output is the target's (exact);
only the proposals depend on the selection.

Cost, honestly: the scoring reads every layer's keys once a round (half of one dense step's K/V
reads) and the gather copies BUDGET rows a layer; the paper reads the scores out of its
verification kernel at no cost, which the native layer here does not expose.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..errors import ConfigError
from ..models.layers import apply_rotary, linear, rms_norm, rotary_tables
from ..sampling import SamplingParams
from ..spec.types import DraftTree, VerifyResult
from .base import Budget
from .model import ModelDrafter
from .registry import DrafterEntry, register

USAGE = "sparsespec[:BUDGET[,SINK[,RECENT]]]"
FAR = 1 << 40  # pack's window width that restricts nothing: only the shifted positions are wanted
QUERY_ROWS = 4  # the last verified rows whose attention picks the keys (scoring costs grow with them)


@dataclass(frozen=True)
class Sparsity:
    budget: int = 256  # keys kept per layer and K/V head, sink and recent included
    sink: int = 4  # the first positions, always kept
    recent: int = 32  # the last committed positions, always kept

    def __str__(self) -> str:
        return f"{self.budget},{self.sink},{self.recent}"


def parse_argument(text: str) -> Sparsity:
    if not text:
        return Sparsity()
    parts = text.split(",")
    if len(parts) > 3 or not all(p.isdigit() for p in parts):
        raise ConfigError(f"give up to three whole numbers, as in {USAGE} (sparsespec:256,4,32)")
    values = [int(p) for p in parts]
    defaults = Sparsity()
    budget, sink, recent = values + [defaults.sink, defaults.recent][len(values) - 1:]
    if budget < 1:
        raise ConfigError("BUDGET is the keys kept a layer and head; give BUDGET >= 1 (sparsespec:256,4,32)")
    if sink + recent >= budget:
        raise ConfigError(f"SINK {sink} plus RECENT {recent} leave no room for chosen keys in a BUDGET of {budget}; "
                          f"give BUDGET > SINK + RECENT (sparsespec:256,4,32)")
    return Sparsity(budget, sink, recent)


def check_fits(sparsity: Sparsity, target_config, target_path: Path) -> str | None:
    context = int(target_config.max_position_embeddings)
    if sparsity.budget >= context:
        return (f"a BUDGET of {sparsity.budget} keys is the target's whole context of {context} tokens, so nothing "
                "would ever be dropped; give a smaller BUDGET")
    return None


def select(queries: torch.Tensor, keys: torch.Tensor, sparsity: Sparsity) -> torch.Tensor:
    """queries [H, n, D] (rotated), keys [G, L, D] -> kept positions [G, k] (sorted, k = min(BUDGET, L)):
    per K/V head, the sink, the recent and the best of the rest by softmax mass summed over the
    n rows and the H / G query heads of the group."""
    G, L, D = keys.shape
    if L <= sparsity.budget:
        return torch.arange(L).expand(G, L)
    H, n, _ = queries.shape
    scores = queries.reshape(G, (H // G) * n, D).float() @ keys.float().transpose(1, 2)  # [G, rows, L]
    mass = torch.softmax(scores / math.sqrt(D), dim=-1).sum(1)  # [G, L]
    mass[:, : sparsity.sink] = math.inf
    mass[:, L - sparsity.recent:] = math.inf
    return mass.topk(sparsity.budget, dim=-1).indices.sort(dim=-1).values


class SparseDrafter(ModelDrafter):
    """The target's every layer, drafting over the kept keys of its own cache (module notes)."""

    def __init__(self, target, shape, sparsity: Sparsity):
        super().__init__(target, shape, name=f"sparsespec:{sparsity}")
        self.sparsity = sparsity
        layers = target.config.num_layers
        self.capabilities = replace(ModelDrafter.capabilities, reads_target_cache=True,
                                    needs_hidden=tuple(range(layers)))  # the input of every layer
        self.source = None  # the target's KVCache (read only)
        self._target_slots: dict[int, int] = {}
        self._rows: dict[int, torch.Tensor | None] = {}  # seq -> the last verified rows' taps [n, layers, E]
        self.kept_share: list[float] = []  # per proposal: kept keys / committed keys (the measurement)

    def attach_target_cache(self, cache) -> None:
        for seq_id in list(self._states):
            self.finish(seq_id, [])
        self.source = cache  # read, never written: self.cache stays the drafter's own

    def start(self, seq_id: int, prompt: list[int], params: SamplingParams | None = None,
              target_slot: int | None = None, hidden: torch.Tensor | None = None) -> None:
        if self.source is None or target_slot is None:
            raise ValueError(f"{self.name} drafts from the target's cache: attach it, and give start() the target_slot")
        super().start(seq_id, prompt[-1:], params)  # a slot of its own, nothing written
        self._states[seq_id].cached = len(prompt) - 1
        self._target_slots[seq_id] = target_slot
        self._rows[seq_id] = None if hidden is None else hidden[-QUERY_ROWS:]

    def propose_batch(self, seq_ids: list[int], tokens: list[list[int]], budgets: list[Budget]) -> list[DraftTree]:
        states = [self._states[s] for s in seq_ids]
        kept = [self._select(s, len(toks) - 1) for s, toks in zip(seq_ids, tokens)]  # [layers, G, k] each
        depths = [self.shape.max_depth(b.depth) for b in budgets]
        self.slots.ensure_rows(max(k.shape[-1] + 1 + self.shape.fed_nodes(d) for k, d in zip(kept, depths)))
        for seq_id, st, toks, rows in zip(seq_ids, states, tokens, kept):
            self._gather(self._target_slots[seq_id], st.slot, rows)
            st.cached = len(toks) - 1
            st.shift = st.cached - rows.shape[-1]  # the root sits at row k, its position is len - 1
            self.kept_share.append(rows.shape[-1] / max(st.cached, 1))
        return super().propose_batch(seq_ids, tokens, budgets)

    def update(self, seq_id: int, result: VerifyResult, hidden: torch.Tensor | None = None) -> None:
        if hidden is not None:
            self._rows[seq_id] = hidden[-QUERY_ROWS:]  # the root's and the accepted drafts' rows
        self._states[seq_id].proposed = False  # nothing to roll back: the next round gathers afresh

    def update_batch(self, seq_ids: list[int], results: list[VerifyResult], hidden: list) -> None:
        for seq_id, result, h in zip(seq_ids, results, hidden):
            self.update(seq_id, result, h)

    def finish(self, seq_id: int, tokens: list[int]) -> None:
        self._target_slots.pop(seq_id, None)
        self._rows.pop(seq_id, None)
        super().finish(seq_id, tokens)

    # -- the selection and the gather ---------------------------------------------------------
    def _windowed(self, states) -> dict:
        """Positions past the kept rows are shifted to the true ones; the window restricts nothing."""
        return {"shifts": [st.shift for st in states], "window": (0, FAR)}

    @torch.inference_mode()
    def _select(self, seq_id: int, length: int) -> torch.Tensor:
        """Kept positions [layers, G, k] of the committed prefix (rows 0..length-1 of the target's slot)."""
        c, target = self.decoder.config, self.decoder
        G = c.num_kv_heads
        if length <= self.sparsity.budget:
            return torch.arange(length).expand(c.num_layers, G, length)
        rows = self._rows.get(seq_id)
        if rows is None:  # no query yet (a one-token prompt): the most recent keys
            recent = torch.arange(length - self.sparsity.budget + self.sparsity.sink, length)
            kept = torch.cat([torch.arange(self.sparsity.sink), recent])
            return kept.expand(c.num_layers, G, kept.shape[0])
        H, D, n = c.num_heads, c.head_dim, rows.shape[0]
        positions = torch.arange(length - n, length, device=target.device).view(1, n)
        cos, sin = rotary_tables(positions, target.inv_freq, target.dtype)
        slot = self._target_slots[seq_id]
        out = []
        for index, w in enumerate(target.layers):
            h = rms_norm(rows[:, index].unsqueeze(0).to(target.dtype), w.input_norm, c.rms_norm_eps)  # [1, n, E]
            q = linear(h, w.qkv, w.qkv_bias)[..., : H * D].view(1, n, H, D).transpose(1, 2)  # [1, H, n, D]
            if w.q_norm is not None:
                q = rms_norm(q, w.q_norm, c.rms_norm_eps)
            q = apply_rotary(q, cos, sin)[0]
            out.append(select(q, self.source.k[index][slot, :, :length], self.sparsity).cpu())
        return torch.stack(out)

    @torch.inference_mode()
    def _gather(self, target_slot: int, own_slot: int, kept: torch.Tensor) -> None:
        """Copy the kept rows [layers, G, k] of the target's slot to rows 0..k-1 of the drafter's slot."""
        k = kept.shape[-1]
        cache = self.cache
        D = self.decoder.config.head_dim
        for index in range(len(cache.k)):
            at = kept[index].to(cache.k[index].device).unsqueeze(-1).expand(-1, k, D)  # [G, k, D]
            cache.k[index][own_slot, :, :k] = self.source.k[index][target_slot].gather(1, at)
            cache.v[index][own_slot, :, :k] = self.source.v[index][target_slot].gather(1, at)


def build(sparsity: Sparsity, shape, target, target_path: Path) -> SparseDrafter:
    return SparseDrafter(target, shape, sparsity)


register(DrafterEntry("sparsespec", USAGE, replace(ModelDrafter.capabilities, reads_target_cache=True),
                      build=build, parse_argument=parse_argument, check_fits=check_fits))
