"""Pipeline-sharded speculation (seed #8): the target's layers on N stages, the engine unchanged.

    llm = LLM(path, drafter="draft-model:smollm2-135m-instruct@q4")
    split_llm(llm, stages=2, hop_ms=20)          # pipeline_llm.py: its target now on 2 stages (Ray actors)
    llm.generate("def fib(n):", 64)              # greedy text equal to one process's

`PipelineTarget` is the target as the engine sees it (a `Decoder`'s config, new_cache and
forward): each forward goes once through the stages, stage to stage (pipeline_stage.py: the first
holds the embedding, the last the norm and head), and the logits come back. The engine, its
drafter and its verifier run on the coordinator, the process that holds the engine: a draft
model proposes K tokens there and one traversal of the pipeline verifies them, so the N link
crossings of a traversal are paid once per round instead of once per token. `PipelineState` is
the engine's view of the slots: lengths on the host, each state call (set_length, compact, ...)
recorded and carried to every stage by the next forward, so a rewind costs no message of its own.

Hops: the coordinator sits with stage 0 (the machine with the embedding and the draft model);
a traversal crosses N links, stage i-1 -> i for i >= 1 and the last stage back to the
coordinator; `hop_ms` is a simulated delay per crossing (0 with one stage). Transports: "local"
(the stages in this process, one after another: tests, the reference) and "ray"
(pipeline_ray.py: a Ray actor a stage, the rows handed actor to actor through Ray's object
store; on a Ray cluster a stage a machine). With micro_batches > 1 a batch of several sequences
goes down the pipeline in that many groups of sequences, so stage i works on one group while
stage i + 1 works on the one before (Ray only).
"""

from __future__ import annotations

import time
import weakref
from dataclasses import replace

import torch

from ..errors import ConfigError, OutriderError
from ..kernels.dispatch import PrefillPath
from ..models.batch import ForwardBatch
from ..models.decoder import ForwardOutput
from .pipeline_stage import REWINDS, PipelineStage, check_splittable, stage_bounds, stage_decoder

TRANSPORTS = ("local", "ray")


class StageDied(OutriderError, RuntimeError):
    """A stage's process is gone: the pipeline cannot run a forward (one line, naming the stage)."""


class PipelineState:
    """The engine's slot state for a pipeline: lengths on the host; every call the engine makes is
    recorded (`pending`) for the stages, which apply them before the next forward."""

    NOT_ROWS = "the K/V lives on the pipeline's stages, not in this process"  # why the prefix cache is off

    def __init__(self, cache_id: int, num_slots: int, max_len: int, nbytes: int):
        self.cache_id = cache_id
        self.lengths = [0] * num_slots
        self.max_len = self.scratch_row = max_len
        self.pending: list[tuple[str, tuple]] = []
        self._nbytes = nbytes  # the stages' K/V bytes when made

    @property
    def num_slots(self) -> int:
        return len(self.lengths)

    def free_rows(self, slot: int) -> int:
        return self.max_len - self.lengths[slot]

    def set_length(self, slot: int, length: int) -> None:
        if not 0 <= length <= self.max_len:
            raise ValueError(f"slot {slot}: length {length} outside [0, {self.max_len}]")
        self.lengths[slot] = length
        self.pending.append(("set_length", (slot, length)))

    def compact(self, slot: int, src_rows: list[int], dst_start: int) -> None:
        if any(s != dst_start + i for i, s in enumerate(src_rows)):  # a chain is in place already
            self.pending.append(("compact", (slot, list(src_rows), dst_start)))

    def copy_rows(self, src_slot: int, dst_slot: int, n: int) -> None:
        self.pending.append(("copy_rows", (src_slot, dst_slot, n)))

    def can_copy_prefix(self, src_slot: int, n: int) -> bool:
        return True

    def ensure_capacity(self, slot_rows: int) -> None:
        if slot_rows > self.max_len:
            self.max_len = self.scratch_row = max(slot_rows, 2 * self.max_len)
            self.pending.append(("ensure_capacity", (slot_rows,)))

    def grow_slots(self, num_slots: int) -> None:
        if num_slots > self.num_slots:
            self.lengths += [0] * (num_slots - self.num_slots)
            self.pending.append(("grow_slots", (num_slots,)))

    def nbytes(self) -> int:
        return self._nbytes

    def take(self) -> list:
        ops, self.pending = self.pending, []
        return ops


class LocalStages:
    """The stages in this process, run one after another (the reference transport)."""

    def __init__(self, stages: list[PipelineStage]):
        self.stages = stages

    def new_cache(self, cache_id: int, num_slots: int, max_len: int, dropped: list[int]) -> int:
        for stage in self.stages:
            for old in dropped:
                stage.caches.pop(old, None)
        return sum(s.new_cache(cache_id, num_slots, max_len) for s in self.stages)

    def run(self, cache_id: int, ops: list, batches: list[ForwardBatch]) -> list[torch.Tensor]:
        out = []
        for j, batch in enumerate(batches):
            x = None
            for i, stage in enumerate(self.stages):
                x = stage.forward(cache_id, ops if j == 0 else [], batch, x, hop=i > 0)
            out.append(x)
        return out

    def busy(self) -> list[float]:
        return [s.busy() for s in self.stages]

    def set_hop(self, hop_s: float) -> None:
        for stage in self.stages:
            stage.hop_s = hop_s

    def where(self) -> list[str]:
        return [s.where() for s in self.stages]

    def close(self) -> None:
        pass


class PipelineTarget:
    """The target as the engine sees it, its layers on stages (module notes)."""

    def __init__(self, config, stages, *, dtype: torch.dtype, device: torch.device, kv_dtype=None,
                 hop_s: float = 0.0, micro_batches: int = 1, rewind: str = "trim"):
        self.config = config
        self.stages = stages  # LocalStages or pipeline_ray.RayStages
        self.count = len(stages.where())
        self.dtype, self.device, self.kv_dtype = dtype, device, kv_dtype
        self.hop_s = hop_s
        self.micro_batches = micro_batches
        self.rewind = rewind
        self.vision = None  # text only
        self.quantization = None
        self.head_ids = None
        self.traversals = 0  # forwards sent down the pipeline (micro-batches count one each)
        self._next_cache = 0
        self._dropped: list[int] = []  # caches the engine let go of: freed on the stages at the next new_cache

    def new_cache(self, num_slots: int, max_len: int, num_layers: int | None = None, rings: bool = True,
                  pages: int | None = None, page_size: int = 16) -> PipelineState:
        if pages is not None:
            raise ConfigError("paged K/V (--kv-memory) is not run on pipeline stages: leave it out with --pipeline-stages")
        if num_layers is not None:
            raise ConfigError("a cache of the first layers only (early exit) is not run on pipeline stages")
        cache_id, self._next_cache = self._next_cache, self._next_cache + 1
        dropped, self._dropped = self._dropped, []
        nbytes = self.stages.new_cache(cache_id, num_slots, max_len, dropped)
        state = PipelineState(cache_id, num_slots, max_len, nbytes)
        weakref.finalize(state, self._dropped.append, cache_id)
        return state

    def prefill_path(self, batch: ForwardBatch) -> PrefillPath:
        """Not asked of a pipeline (its prefix cache is off: its state is not a KVCache)."""
        return PrefillPath.TORCH

    def forward(self, batch: ForwardBatch, cache: PipelineState, num_layers: int | None = None,
                attention: bool = False) -> ForwardOutput:
        if num_layers is not None or attention or batch.hidden_layers or batch.embeds is not None:
            raise ConfigError("a pipeline forward gives logits only (no early exit, hidden states, attention "
                              "scores or image rows): use a drafter that reads none (draft-model, suffix, ngram)")
        groups = micro_groups(len(batch.slot_ids), self.micro_batches)
        parts = [batch] if len(groups) == 1 else [rows_of(batch, lo, hi) for lo, hi in groups]
        outs = self.stages.run(cache.cache_id, cache.take(), parts)
        self.traversals += len(parts)
        if self.count > 1 and self.hop_s:  # the last stage's logits back to the coordinator
            time.sleep(self.hop_s)
        logits = outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
        return ForwardOutput(logits=logits, hidden={})

    def set_hop(self, hop_ms: float) -> None:
        """A new simulated delay a link crossing, on the stages and here (a sweep over hop latency)."""
        self.hop_s = hop_ms / 1000
        self.stages.set_hop(self.hop_s)

    def close(self) -> None:
        self.stages.close()


def micro_groups(rows: int, micro_batches: int) -> list[tuple[int, int]]:
    """Batch rows [lo, hi) of each micro-batch: `micro_batches` groups as even as can be (fewer when
    there are fewer rows)."""
    n = max(1, min(micro_batches, rows))
    return [(lo, hi) for lo, hi in stage_bounds(rows, n)]


def rows_of(batch: ForwardBatch, lo: int, hi: int) -> ForwardBatch:
    """Batch rows lo..hi-1 of `batch` as a batch of their own, over the same span of slots (the
    others are holes) and the same cache rows: what those rows' forward computes is unchanged."""
    B, T = batch.tokens.shape
    place = batch.span_place if batch.span_place is not None else torch.arange(B, device=batch.tokens.device)
    flat = batch.logits_flat
    if flat is not None:
        flat = flat[(flat >= lo * T) & (flat < hi * T)] - lo * T
    pick = slice(lo, hi)
    return replace(
        batch, slot_ids=batch.slot_ids[pick], tokens=batch.tokens[pick], positions=batch.positions[pick],
        rows=batch.rows[pick], attn_mask=None if batch.attn_mask is None else batch.attn_mask[pick],
        logits_rows=None if batch.logits_rows is None else batch.logits_rows[pick], span_place=place[pick],
        logits_flat=flat, key_pos=None if batch.key_pos is None else batch.key_pos[pick],
        starts=None if batch.starts is None else batch.starts[pick],
        ends=None if batch.ends is None else batch.ends[pick])


def check_hop_and_rewind(hop_ms: float, rewind: str) -> None:
    if isinstance(hop_ms, bool) or not isinstance(hop_ms, (int, float)) or not 0 <= hop_ms <= 10_000:
        raise ConfigError(f"--pipeline-hop-ms must be a number of milliseconds in [0, 10000], got {hop_ms!r}")
    if rewind not in REWINDS:
        raise ConfigError(f"--pipeline-rewind must be one of {', '.join(REWINDS)}, got {rewind!r}")


def local_pipeline(whole, stages: int, *, hop_ms: float = 0.0, rewind: str = "trim") -> PipelineTarget:
    """A PipelineTarget of `whole`'s layers cut into `stages` stages in this process (the tensors
    are `whole`'s, not copies)."""
    check_options(whole.config, stages, hop_ms, rewind, 1)
    bounds = stage_bounds(whole.config.num_layers, stages)
    parts = [PipelineStage(stage_decoder(whole, lo, hi, i == 0, i == stages - 1), i, stages, (lo, hi), rewind,
                           hop_ms / 1000) for i, (lo, hi) in enumerate(bounds)]
    return PipelineTarget(whole.config, LocalStages(parts), dtype=whole.dtype, device=whole.device,
                          kv_dtype=whole.kv_dtype, hop_s=hop_ms / 1000, rewind=rewind)


def check_options(config, stages: int, hop_ms: float, rewind: str, micro_batches: int) -> None:
    check_splittable(config, stages)
    check_hop_and_rewind(hop_ms, rewind)
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ConfigError(f"--pipeline-micro-batches must be a positive integer, got {micro_batches!r}")
