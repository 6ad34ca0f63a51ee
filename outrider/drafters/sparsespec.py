"""`--drafter sparsespec[:BUDGET[,SINK[,RECENT]]]`: SparseSpec-L, self-speculation over a sparse,
recallable K/V cache (issue 26, item 3).

Zhao, Tang, Zhu et al., "Accelerating Large-Scale Reasoning Model Inference with Sparse
Self-Speculative Decoding", arXiv 2512.01278 (2025): the target drafts for itself with every
layer, but each draft forward attends only to the keys that mattered to the last full
(verification) forward - their PillarAttn - while verification attends to everything.

Here, each round:

1. Selection (sparsespec_select.py). Where the native layer runs the target, the verify forward
   itself adds up the attention weights its rows (the root and every draft) gave each key, per
   layer and K/V head (`needs_attention`: the scores option, no recomputation); the first round,
   before any verify, keeps the sink and the most recent keys. Elsewhere (the slow path, the
   reference) the verify forward taps the hidden state entering every layer at the rows of the
   root and the accepted drafts (`needs_hidden`; the prefill's taps give the first round the
   prompt's last rows), and those rows' queries are recomputed and scored against every layer's
   keys in torch. Per layer and per K/V head, the kept keys are the SINK first
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

Cost: with the native layer the scores cost a sum over the verify's attention weights and a
top-k per layer and head; the slow path reads every layer's keys once a round (half of one dense
step's K/V reads). The gather copies BUDGET rows a layer either way.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..config import current
from ..errors import ConfigError
from ..sampling import SamplingParams
from ..spec.types import Budget, DraftTree, VerifyResult
from .model import ModelDrafter
from .registry import DrafterEntry, register
from .sparsespec_select import keep, select, select_torch  # noqa: F401  (select: the tests' and scripts')

USAGE = "sparsespec[:BUDGET[,SINK[,RECENT]]]"
FAR = 1 << 40  # pack's window width that restricts nothing: only the shifted positions are wanted
QUERY_ROWS = 4  # the slow path's: the last verified rows whose attention picks the keys (its cost grows with them)


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
    if target_config.delta is not None:
        return ("sparsespec drafts over the target's own K/V rows, and this target's gated-delta layers keep "
                "a recurrent state instead; use a draft model, early-exit or a lookup drafter")
    if target_config.mla is not None:
        return ("sparsespec drafts over the target's own per-head K/V rows, and this target's latent-attention "
                "layers keep one latent row a token instead; use a draft model, early-exit or a lookup drafter")
    if target_config.layer_windows and current().sliding_ring:
        return ("sparsespec drafts over the target's own K/V rows by position, and this target's sliding-window "
                "layers keep only their window's rows, in rings; use a draft model, early-exit or a lookup drafter "
                "(or --config sliding_ring=off to keep every row)")
    context = int(target_config.max_position_embeddings)
    if sparsity.budget >= context:
        return (f"a BUDGET of {sparsity.budget} keys is the target's whole context of {context} tokens, so nothing "
                "would ever be dropped; give a smaller BUDGET")
    return None


class SparseDrafter(ModelDrafter):
    """The target's every layer, drafting over the kept keys of its own cache (module notes)."""

    def __init__(self, target, shape, sparsity: Sparsity, native_scores: bool | None = None):
        """native_scores: the verify forward's scores (the native layer's option); False, the slow
        path (taps, queries recomputed in torch); None, the first wherever the native layer runs
        the target."""
        super().__init__(target, shape, name=f"sparsespec:{sparsity}")
        self.sparsity = sparsity
        if native_scores is None:
            from ..kernels.decoder_layer import NativeLayers

            native_scores = target.device.type == "cpu" and NativeLayers.of(target) is not None
        self.native_scores = native_scores
        layers = target.config.num_layers
        self.capabilities = replace(ModelDrafter.capabilities, reads_target_cache=True, needs_attention=True) \
            if native_scores else replace(ModelDrafter.capabilities, reads_target_cache=True,
                                          needs_hidden=tuple(range(layers)))  # the input of every layer
        self.source = None  # the target's KVCache (read only)
        self._target_slots: dict[int, int] = {}
        self._rows: dict[int, torch.Tensor | None] = {}  # seq -> the last verified rows' taps [n, layers, E]
        self._mass: dict[int, torch.Tensor | None] = {}  # seq -> the last verify's scores [layers, G, kv_len]
        self.kept_share: list[float] = []  # per proposal: kept keys / committed keys (the measurement)

    def attach_target_cache(self, cache) -> None:
        for seq_id in list(self._states):
            self.finish(seq_id, [])
        self.source = cache  # read, never written: self.cache stays the drafter's own

    def start(self, seq_id: int, prompt: list[int], params: SamplingParams | None = None,
              target_slot: int | None = None, hidden: torch.Tensor | None = None, coupled: bool = False) -> None:
        if self.source is None or target_slot is None:
            raise ValueError(f"{self.name} drafts from the target's cache: attach it, and give start() the target_slot")
        super().start(seq_id, prompt[-1:], params, coupled=coupled)  # a slot of its own, nothing written
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

    def observe_attention(self, seq_ids: list[int], attention: list) -> None:
        """The verify forward's scores per sequence ([layers, G, kv_len], or None: not the native layer)."""
        for seq_id, mass in zip(seq_ids, attention):
            self._mass[seq_id] = mass

    def update_batch(self, seq_ids: list[int], results: list[VerifyResult], hidden: list) -> None:
        for seq_id, result, h in zip(seq_ids, results, hidden):
            self.update(seq_id, result, h)

    def finish(self, seq_id: int, tokens: list[int]) -> None:
        self._target_slots.pop(seq_id, None)
        self._rows.pop(seq_id, None)
        self._mass.pop(seq_id, None)
        super().finish(seq_id, tokens)

    # -- the selection and the gather ---------------------------------------------------------
    def _windowed(self, states) -> dict:
        """Positions past the kept rows are shifted to the true ones; the window restricts nothing."""
        return {"shifts": [st.shift for st in states], "window": (0, FAR)}

    @torch.inference_mode()
    def _select(self, seq_id: int, length: int) -> torch.Tensor:
        """Kept positions [layers, G, k] of the committed prefix (rows 0..length-1 of the target's slot)."""
        c, budget = self.decoder.config, self.sparsity.budget
        G = c.num_kv_heads
        if length <= budget:
            return torch.arange(length).expand(c.num_layers, G, length)
        mass = self._mass.get(seq_id)
        if self.native_scores and mass is not None:  # the fast path: the verify's own weights
            return keep(mass[:, :, :length], budget, self.sparsity.sink, self.sparsity.recent)  # [layers, G, k]
        rows = self._rows.get(seq_id)
        if self.native_scores or rows is None:  # nothing scored yet (the first round): the most recent keys
            recent = torch.arange(length - budget + self.sparsity.sink, length)
            kept = torch.cat([torch.arange(self.sparsity.sink), recent])
            return kept.expand(c.num_layers, G, kept.shape[0])
        return select_torch(self.decoder, self.source, self._target_slots[seq_id], rows, length, self.sparsity)

    @torch.inference_mode()
    def _gather(self, target_slot: int, own_slot: int, kept: torch.Tensor) -> None:
        """Copy the kept rows [layers, G, k] of the target's slot to rows 0..k-1 of the drafter's slot."""
        self.cache.gather_from(self.source, target_slot, own_slot, kept)


def build(sparsity: Sparsity, shape, target, target_path: Path) -> SparseDrafter:
    return SparseDrafter(target, shape, sparsity)


register(DrafterEntry("sparsespec", USAGE, replace(ModelDrafter.capabilities, reads_target_cache=True),
                      build=build, parse_argument=parse_argument, check_fits=check_fits))
