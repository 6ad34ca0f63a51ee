"""One stage of a pipeline-sharded target (seed #8): a contiguous run of the target's layers.

A stage holds its layers' weights and their K/V state, nothing else: the first stage also the
token embedding, the last also the final norm and LM head. Its forward takes the engine's batch
(positions, cache rows, mask: small host tensors) and the rows the previous stage produced
([B, T, E]), and gives the next stage its rows, or, on the last stage, the logits. The layers
run through `Decoder.forward` (rows= / head=), so a stage computes exactly what the whole
model's forward computes for those layers: the native layer where it runs the model, the torch
layers elsewhere.

The engine's state calls on the pipeline's slots (set_length, compact, copy_rows, ...) reach every
stage as `ops` carried by the next forward (pipeline.py), applied in order before it runs.

Rewind: "trim" keeps a `KVCache` (a rejected row is cut back by the length, an accepted tree path
copied down: what one process does); "mask" keeps every row where it was written and masks the
rejected ones out (pipeline_rewind.py: the paper's mask-based rewind). Both give the same bits.

`PipelineStage` is a plain class: in-process (tests, `transport="local"`) or inside a Ray actor
(pipeline_ray.py); `hop_s` is a simulated link delay paid when rows arrive from another machine.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import replace

import torch

from ..errors import ConfigError
from ..models.batch import ForwardBatch
from ..models.decoder import Decoder
from .pipeline_rewind import MaskedRows

REWINDS = ("trim", "mask")


def check_splittable(config, stages: int) -> None:
    """ConfigError unless `config`'s layers can be cut into `stages` contiguous stages."""
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ConfigError(f"--pipeline-stages must be a positive integer, got {stages!r}")
    if stages > config.num_layers:
        raise ConfigError(f"--pipeline-stages {stages}: the model has only {config.num_layers} layers")
    c = config
    kind = ("gated-delta or other mixers" if c.layer_kinds else "mixture-of-experts MLPs" if c.mlp_kinds
            else "sliding windows" if c.layer_windows else "latent attention" if c.mla is not None
            else None if c.plain_block else "Gemma-style blocks")
    if kind:
        raise ConfigError(f"pipeline stages split a plain attention model (the Llama, Qwen2, Qwen3 families); "
                          f"this model has {kind}: run it without --pipeline-stages")


def stage_bounds(num_layers: int, stages: int) -> list[tuple[int, int]]:
    """Layers [lo, hi) of each stage, as even as can be (earlier stages one more)."""
    size, extra = divmod(num_layers, stages)
    bounds, lo = [], 0
    for i in range(stages):
        hi = lo + size + (1 if i < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def stage_decoder(whole: Decoder, lo: int, hi: int, first: bool, last: bool) -> Decoder:
    """The Decoder of layers [lo, hi) of `whole`: its embedding when first, its norm and head when
    last (else a one-row stand-in of the compute dtype: never read)."""
    E = whole.config.hidden_size
    stand_in = torch.zeros(1, E, dtype=whole.dtype, device=whole.device)
    part = Decoder(replace(whole.config, num_layers=hi - lo), whole.embed if first else stand_in,
                   whole.layers[lo:hi], whole.norm, whole.lm_head if last else stand_in, whole.quantization,
                   kv_dtype=whole.kv_dtype)
    return part


class PipelineStage:
    def __init__(self, decoder: Decoder, index: int, count: int, bounds: tuple[int, int], rewind: str = "trim",
                 hop_s: float = 0.0):
        if rewind not in REWINDS:
            raise ConfigError(f"rewind must be one of {', '.join(REWINDS)}, got {rewind!r}")
        self.decoder = decoder  # this stage's layers only (stage_decoder)
        self.index, self.count, self.bounds = index, count, bounds
        self.rewind = rewind
        self.hop_s = hop_s
        self.caches: dict[int, object] = {}  # the engine's caches by id: a KVCache or MaskedRows
        self.busy_s = 0.0  # seconds in forwards (the layers' work, hops excluded)

    @classmethod
    def load(cls, path: str, index: int, count: int, *, device: str = "cpu", dtype: str | None = None,
             kv_dtype: str | None = None, rewind: str = "trim", hop_s: float = 0.0, runtime=None,
             threads: int | None = None) -> "PipelineStage":
        """Stage `index` of `count` from a model folder (a Ray actor's constructor: its own process).
        The whole model is read, then only this stage's tensors are kept."""
        from .. import config as runtime_config
        from ..weights.loader import auto_dtype, load_decoder, parse_dtype, parse_kv_dtype, resolve_device

        if runtime is not None or threads is not None:
            runtime_config.use(runtime, **({"threads": threads} if threads is not None else {}))
        if threads is not None:
            torch.set_num_threads(threads)
        torch_device = resolve_device(device)
        torch_dtype = parse_dtype(dtype) if dtype else auto_dtype(path, torch_device)
        whole = load_decoder(path, torch_device, torch_dtype, kv_dtype=parse_kv_dtype(kv_dtype))
        check_splittable(whole.config, count)
        lo, hi = stage_bounds(whole.config.num_layers, count)[index]
        part = stage_decoder(whole, lo, hi, index == 0, index == count - 1)
        return cls(part, index, count, (lo, hi), rewind, hop_s)

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    def where(self) -> str:
        lo, hi = self.bounds
        return f"stage {self.index} (layers {lo}-{hi - 1}) on {socket.gethostname()} pid {os.getpid()}"

    def new_cache(self, cache_id: int, num_slots: int, max_len: int) -> int:
        """A state for the engine's cache `cache_id`; its bytes."""
        kv = self.decoder.new_cache(num_slots, max_len if self.rewind == "trim" else 2 * max_len)
        self.caches[cache_id] = kv if self.rewind == "trim" else MaskedRows(kv, max_len)
        return self.caches[cache_id].nbytes()

    def apply(self, cache_id: int, ops: list) -> None:
        """The engine's state calls since the last forward, in order: (name, args)."""
        state = self.caches[cache_id]
        for name, args in ops:
            getattr(state, name)(*args)

    def forward(self, cache_id: int, ops: list, batch: ForwardBatch, rows: torch.Tensor | None,
                hop: bool = True) -> torch.Tensor:
        """ops applied, then this stage's layers over `rows` [B, T, E] (None on the first stage: the
        tokens' embeddings): the rows after its last layer, or on the last stage the logits."""
        if hop and self.hop_s:  # the rows (or, on the first stage, the tokens) crossed a link
            time.sleep(self.hop_s)
        start = time.perf_counter()
        self.apply(cache_id, ops)
        state = self.caches[cache_id]
        kv = state
        if isinstance(state, MaskedRows):
            batch, kv = state.physical(batch), state.kv
        out = self.decoder.forward(batch, kv, rows=rows, head=self.last)
        result = out.logits if self.last else out.hidden[len(self.decoder.layers)]
        self.busy_s += time.perf_counter() - start
        return result

    def busy(self) -> float:
        return self.busy_s
