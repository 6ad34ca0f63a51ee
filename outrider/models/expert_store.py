"""Experts that live off the fast tier (issue 41 item 3): an LRU set of at most `budget` experts in
memory, the rest read from the safetensors file on demand, every read counted (bytes and seconds),
with prefetch on a hint.

    store = ExpertStore([path, ...], layers, experts, budget)
    gate_up, down = store.get(layer, e)      # [2I, H], [H, I]: resident, or read now (a miss)
    store.prefetch([(layer, e), ...])        # a hint: read these in the background
    gate_ups, downs = store.layer(layer)     # sequences moe_layer.MoeWeights takes as gate_up / down
    store.stats                              # hits, misses, bytes_read, read_s, stall_s, evictions, ...

The file's experts are read in either Hugging Face layout: one tensor per expert
(`model.layers.{l}.mlp.experts.{e}.gate_proj.weight`, `up_proj`, `down_proj`: Qwen2/3-MoE, the
MoE made by train/moe_split.py) or transformers 5's fused 3-D tensors
(`mlp.experts.gate_up_proj` [N, 2I, H], `mlp.experts.down_proj` [N, H, I]), one expert sliced
out (safe_open's get_slice reads only that expert's bytes). `bytes_read` counts the bytes of the
tensors read, as stored in the file.

The seam: moe_layer.moe_mlp reads `w.gate_up[e]` and then `w.down[e]` for each chosen expert e
and nothing else of the experts, so `MoeWeights(router, *store.layer(l))` runs a layer through the
store with no change to the layer (tests/test_expert_store.py). Wiring it into the loader (an
expert budget for `outrider generate`) is left: weights/mlp_load.py builds resident lists today.
`ResidentExperts` is the slow reference: every expert in memory, the same interface.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import ModelError


@dataclass
class StoreStats:
    uses: int = 0  # get() calls: an expert used once by a layer's forward is one use
    hits: int = 0  # get() found the expert resident (or its prefetch finished)
    misses: int = 0  # get() had to read it (or wait for its prefetch)
    bytes_read: int = 0  # bytes read from the file, demand and prefetch
    read_s: float = 0.0  # seconds spent reading (demand and prefetch)
    stall_s: float = 0.0  # seconds get() waited for a read (demand reads and unfinished prefetches)
    evictions: int = 0
    prefetched: int = 0  # experts read on a hint
    prefetch_used: int = 0  # of those, asked for by get() before being evicted

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class _Entry:
    gate_up: torch.Tensor | None = None  # [2I, H]
    down: torch.Tensor | None = None  # [H, I]
    pending: Future | None = None
    prefetched: bool = False


class ExpertStore:
    def __init__(self, paths, layers: int, experts: int, budget: int, dtype: torch.dtype | None = None,
                 prefix: str = "model.layers.{layer}.mlp.experts"):
        if budget < 1:
            raise ModelError(f"an expert budget of {budget} holds nothing: give at least 1")
        self.layers, self.experts, self.budget, self.dtype, self.prefix = layers, experts, budget, dtype, prefix
        self.stats = StoreStats()
        self._files = [safe_open(str(p), framework="pt") for p in ([paths] if isinstance(paths, (str, Path)) else paths)]
        self._where = {name: f for f in self._files for name in f.keys()}
        self._resident: OrderedDict[tuple[int, int], _Entry] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()  # the LRU set
        self._count = threading.Lock()  # bytes_read and read_s (the prefetch thread adds too)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="expert-prefetch")
        self._name(0, 0, "down_proj")  # refuse a file without experts now, in one line

    # -- reading ------------------------------------------------------------------------------
    def _name(self, layer: int, e: int, proj: str) -> tuple[str, int | None]:
        """(tensor name, index into its first axis or None) of expert e's `proj` in layer `layer`."""
        base = self.prefix.format(layer=layer)
        one = f"{base}.{e}.{proj}.weight"
        if one in self._where:
            return one, None
        fused = f"{base}.{'gate_up_proj' if proj in ('gate_proj', 'up_proj') else 'down_proj'}"
        if fused in self._where:
            return fused, e
        raise ModelError(f"no expert tensor {one} (nor {fused}) in the store's files")

    def _read_one(self, name: str, index: int | None) -> torch.Tensor:
        f = self._where[name]
        t = f.get_tensor(name) if index is None else f.get_slice(name)[index]
        with self._count:
            self.stats.bytes_read += t.numel() * t.element_size()
        return t if self.dtype is None else t.to(self.dtype)

    def _read(self, layer: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not (0 <= layer < self.layers and 0 <= e < self.experts):
            raise ModelError(f"expert ({layer}, {e}) is outside {self.layers} layers of {self.experts} experts")
        t0 = time.perf_counter()
        gname, gi = self._name(layer, e, "gate_proj")
        if gi is None:  # separate gate_proj and up_proj: fused here as moe_layer wants [gate; up]
            gate_up = torch.cat([self._read_one(gname, None), self._read_one(self._name(layer, e, "up_proj")[0], None)])
        else:
            gate_up = self._read_one(gname, gi)
        down = self._read_one(*self._name(layer, e, "down_proj"))
        with self._count:
            self.stats.read_s += time.perf_counter() - t0
        return gate_up.contiguous(), down.contiguous()

    # -- the LRU set --------------------------------------------------------------------------
    def _admit(self, key: tuple[int, int], entry: _Entry) -> None:
        """Called under the lock: key becomes most recent; the least recent beyond budget leave."""
        self._resident[key] = entry
        self._resident.move_to_end(key)
        while len(self._resident) > self.budget:
            old_key, old = next(iter(self._resident.items()))
            if old.pending is not None and not old.pending.done():
                break  # never drop an in-flight read; the set shrinks back on a later admit
            del self._resident[old_key]
            self.stats.evictions += 1

    def get(self, layer: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e of `layer`: (gate_up [2I, H], down [H, I]), read now if not resident."""
        key = (layer, e)
        with self._lock:
            entry = self._resident.get(key)
            if entry is not None:
                self._resident.move_to_end(key)
        self.stats.uses += 1
        if entry is not None and entry.pending is not None:
            if not entry.pending.done():
                t0 = time.perf_counter()
                entry.pending.result()
                self.stats.stall_s += time.perf_counter() - t0
                self.stats.misses += 1
            else:
                entry.pending.result()  # a failed read raises here
                self.stats.hits += 1
            entry.pending = None
            if entry.prefetched:
                self.stats.prefetch_used += 1
                entry.prefetched = False
            return entry.gate_up, entry.down
        if entry is not None:
            self.stats.hits += 1
            return entry.gate_up, entry.down
        t0 = time.perf_counter()
        gate_up, down = self._read(layer, e)
        self.stats.stall_s += time.perf_counter() - t0
        self.stats.misses += 1
        with self._lock:
            self._admit(key, _Entry(gate_up, down))
        return gate_up, down

    def prefetch(self, keys) -> None:
        """A hint: read these (layer, expert) pairs in the background unless resident or in flight.
        They enter the LRU set as most recent (evicting the least recent beyond budget)."""
        for key in keys:
            key = (int(key[0]), int(key[1]))
            with self._lock:
                if key in self._resident:
                    continue
                entry = _Entry(prefetched=True)
                entry.pending = self._pool.submit(self._fill, key, entry)
                self.stats.prefetched += 1
                self._admit(key, entry)

    def _fill(self, key: tuple[int, int], entry: _Entry) -> None:
        entry.gate_up, entry.down = self._read(*key)

    def peek(self, layer: int, e: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Expert e of `layer` if resident and read, without counting a use or reordering; else None."""
        with self._lock:
            entry = self._resident.get((layer, e))
        if entry is None or entry.pending is not None:
            return None
        return entry.gate_up, entry.down

    def wait(self) -> None:
        """Block until every prefetch issued so far has finished."""
        self._pool.submit(lambda: None).result()

    def resident(self) -> list[tuple[int, int]]:
        """The resident (layer, expert) pairs, least recently used first."""
        with self._lock:
            return list(self._resident)

    def layer(self, layer: int) -> tuple["LayerExperts", "LayerExperts"]:
        """(gate_up, down) sequences of `layer`'s experts for moe_layer.MoeWeights."""
        return LayerExperts(self, layer, 0), LayerExperts(self, layer, 1)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class LayerExperts:
    """One layer's experts' gate_up (part 0) or down (part 1) matrices, indexed by expert: each
    index goes through the store's get (so a resident expert is a hit)."""

    def __init__(self, store, layer: int, part: int):
        self.store, self.layer_index, self.part = store, layer, part

    def __len__(self) -> int:
        return self.store.experts

    def __getitem__(self, e: int) -> torch.Tensor:
        """moe_mlp reads gate_up[e] and then down[e]: the first is the use (counted by the store's
        get), the second takes the same resident entry without counting it again."""
        if self.part == 1:
            pair = self.store.peek(self.layer_index, int(e))
            if pair is not None:
                return pair[1]
        return self.store.get(self.layer_index, int(e))[self.part]


class ResidentExperts:
    """The reference: every expert of the files in memory, the same get / layer interface."""

    def __init__(self, paths, layers: int, experts: int, dtype: torch.dtype | None = None,
                 prefix: str = "model.layers.{layer}.mlp.experts"):
        store = ExpertStore(paths, layers, experts, layers * experts, dtype, prefix)
        self.experts = experts
        self._all = {(l, e): store._read(l, e) for l in range(layers) for e in range(experts)}
        store.close()

    def get(self, layer: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._all[(layer, e)]

    def peek(self, layer: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._all[(layer, e)]

    def layer(self, layer: int) -> tuple[LayerExperts, LayerExperts]:
        return LayerExperts(self, layer, 0), LayerExperts(self, layer, 1)
