"""The gated-delta layers' state of every slot: what a K/V cache is to attention, for a layer whose
state cannot be cut back by a length.

Per slot and gated-delta layer: the committed state S [HV, dk, dv] (float64, gated_delta.py), the
convolution's last K - 1 inputs [K - 1, conv_dim], and the count of positions folded into them
(`committed`). A forward that is not a plain prefill writes no state: each new token becomes a
**held row** (at the cache row the batch gives it, as attention writes its K/V there) keeping its
convolution input and its TreeWY stash (k, u, gamma). The rows of a verify, a draft model's steps,
a tree: all held, none folded. The state's side of the slot interface (models/state.py):

- keep(slot, n): n == committed changes nothing (a rejected round's rows are written over by the
  next); n > committed folds the held rows committed .. n - 1, which must be a chain (compaction
  puts an accepted path there), into S and the convolution inputs; n == 0 empties the slot;
  0 < n < committed cannot be done (a recurrent state has no rows to cut) and raises.
- commit_path(slot, rows, start): the held rows `rows` (a root-to-node path) are copied to rows
  start, start + 1, ... (as compaction moves K/V rows).
- copy_prefix(src, dst, n): only the whole committed state (n == committed, nothing held).

A plain prefill (new tokens right after the committed ones, nothing held, no tree) is folded by
the forward itself, chunk by chunk (gated_delta.chunked): its rows are committed on arrival.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import ModelError
from .config import DeltaConfig
from .gated_delta import STATE_DTYPE, Stash


@dataclass
class Held:
    """One slot's held rows for one layer, by cache row: each row's convolution input x [C] and
    stash k [HV, dk] (float32), u [HV, dv], gamma [HV] (gamma: from the committed state along its path). Like
    K/V rows, a row stays until written again or folded; which rows a node reads is its mask's."""

    rows: dict[int, tuple] = field(default_factory=dict)

    def take(self, rows: list[int]) -> tuple[torch.Tensor, Stash]:
        """The rows' x [n, C] and stash, in the order given."""
        parts = [self.rows[r] for r in rows]
        return (torch.stack([p[0] for p in parts]),
                Stash(torch.stack([p[1] for p in parts]), torch.stack([p[2] for p in parts]),
                      torch.stack([p[3] for p in parts])))


class DeltaState:
    def __init__(self, layers: list[int], num_slots: int, cfg: DeltaConfig, dtype: torch.dtype,
                 device: torch.device | str):
        self.layers = list(layers)  # the model's layer ids of its gated-delta layers
        self.cfg, self.dtype, self.device = cfg, dtype, device
        # where the verify step and the fold run: csrc/gated_delta.c, or the torch reference (fixed here)
        from ..kernels.delta_native import DeltaOps

        self.ops = DeltaOps.choose(device)
        HV, dk, dv = cfg.num_v_heads, cfg.k_head_dim, cfg.v_head_dim
        self.S = {l: torch.zeros(num_slots, HV, dk, dv, dtype=STATE_DTYPE, device=device) for l in layers}
        self.conv = {l: torch.zeros(num_slots, cfg.conv_kernel - 1, cfg.conv_dim, dtype=dtype, device=device)
                     for l in layers}
        self.committed = [0] * num_slots
        self.held: list[dict[int, Held]] = [{l: Held() for l in layers} for _ in range(num_slots)]

    # -- what a layer's forward reads and writes ------------------------------------------------
    def held_rows(self, slot: int, layer: int) -> list[int]:
        """The rows a layer holds for a slot, ascending (topological: a tree's nodes follow their
        parents, and a round's rows follow the committed ones)."""
        return sorted(self.held[slot][layer].rows)

    def hold(self, slot: int, layer: int, rows: list[int], x, k, u, gamma) -> None:
        """Write rows (a row written again replaces what it held)."""
        h = self.held[slot][layer].rows
        k = k.to(torch.float32)  # exact: k was float32 before the state's arithmetic widened it
        for i, row in enumerate(rows):
            h[row] = (x[i].clone(), k[i], u[i], gamma[i])  # a copy: not a view keeping the whole projection

    def advance(self, slot: int, layer: int, state: torch.Tensor, conv_tail: torch.Tensor, count: int,
                last_layer: bool) -> None:
        """A plain prefill's fold: the layer's new state and convolution inputs; the slot's count
        moves on with the last gated-delta layer."""
        self.S[layer][slot] = state
        self.conv[layer][slot] = conv_tail
        if last_layer:
            self.committed[slot] += count

    # -- the slot interface -------------------------------------------------------------------------
    def keep(self, slot: int, n: int) -> None:
        if n == 0:
            for l in self.layers:
                self.S[l][slot].zero_()
                self.conv[l][slot].zero_()
            self.committed[slot] = 0
            self.held[slot] = {l: Held() for l in self.layers}
        elif n < self.committed[slot]:
            raise ModelError(f"slot {slot}: a gated-delta state holds {self.committed[slot]} positions and "
                             f"cannot be cut back to {n}")
        elif n > self.committed[slot]:
            self._fold(slot, n)

    def _fold(self, slot: int, n: int) -> None:
        """Fold held rows committed .. n - 1 (a chain) into the state; rows past n stay held, their
        gamma now counted from the new state (a later node may still read them: a draft model's
        root row is its next tree's node 0)."""
        want = list(range(self.committed[slot], n))
        for l in self.layers:
            h = self.held[slot][l]
            missing = [row for row in want if row not in h.rows]
            if missing:
                raise ModelError(f"slot {slot}: rows {missing[:3]} were never written; cannot commit up to {n}")
            x, path = h.take(want)
            self.ops.fold_into(self.S[l][slot], path)
            inputs = torch.cat((self.conv[l][slot], x))
            self.conv[l][slot] = inputs[inputs.shape[0] - (self.cfg.conv_kernel - 1):]
            last = path.gamma[-1]
            h.rows = {row: (x_, k_, u_, g_ - last) for row, (x_, k_, u_, g_) in h.rows.items() if row >= n}
        self.committed[slot] = n

    def commit_path(self, slot: int, rows: list[int], start: int) -> None:
        """Held rows `rows` (a root-to-node path) copied to rows start, start + 1, ... (compaction)."""
        for l in self.layers:
            h = self.held[slot][l].rows
            moved = {start + i: h[row] for i, row in enumerate(rows) if row in h}
            h.update(moved)

    def grow_slots(self, num_slots: int) -> None:
        """Hold `num_slots` slots (more than now), keeping every slot's state."""
        extra = num_slots - len(self.committed)
        if extra <= 0:
            return
        for table in (self.S, self.conv):
            for l, old in table.items():
                table[l] = torch.cat((old, old.new_zeros(extra, *old.shape[1:])))
        self.committed += [0] * extra
        self.held += [{l: Held() for l in self.layers} for _ in range(extra)]

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        if n != self.committed[src]:
            raise ModelError(f"a gated-delta state keeps only its whole committed prefix ({self.committed[src]} "
                             f"positions), not the first {n}")
        for l in self.layers:
            self.S[l][dst] = self.S[l][src]
            self.conv[l][dst] = self.conv[l][src]
        self.committed[dst] = n
        self.held[dst] = {l: Held() for l in self.layers}

    def can_copy_prefix(self, src: int, n: int) -> bool:
        return n == self.committed[src]

    def nbytes(self, slot: int | None = None) -> int:
        """Bytes held: committed states and convolution inputs, plus the held rows' stash."""
        slots = range(len(self.committed)) if slot is None else [slot]
        total = 0
        for l in self.layers:
            total += sum(self.S[l][s].numel() * self.S[l][s].element_size() for s in slots)
            total += sum(self.conv[l][s].numel() * self.conv[l][s].element_size() for s in slots)
            for s in slots:
                total += sum(t.numel() * t.element_size() for row in self.held[s][l].rows.values() for t in row)
        return total
