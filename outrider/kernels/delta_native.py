"""The gated delta rule's verify step and fold in the native library (csrc/gated_delta.c), with the
same calls as their torch reference in models/gated_delta.py (`tree_step`, `fold`), and the
choice between the two, made once per model state (`DeltaOps`).

Why native: at a decode step or a short verify the state arithmetic is a few dozen small torch
calls on [HV, dk, dv] float64 tensors per layer and slot, each allocating a fresh 2 MiB state at
Qwen3.5-0.8B's shapes; the C form makes one pass over the state per node and folds in place. Its
node outputs are the reference's algebra summed in another fixed order (tests/test_delta_native.py
holds them to 1e-12 of it), and each node's are the same bits whatever the nodes beside it.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Callable

import torch

from ..models import gated_delta
from ..models.gated_delta import STATE_DTYPE, Stash
from . import native


def _ptr(t: torch.Tensor):
    return ctypes.c_void_p(t.data_ptr())


def tree_step(q, k, v, g, beta, state, ancestors, held: Stash | None = None, held_ancestors=None):
    """gated_delta.tree_step in the native library: same arguments, same results (o [N, HV, dv]
    float64, the new nodes' Stash with k float32)."""
    lib = native.library()
    N, HV, dk = k.shape
    dv = v.shape[-1]
    f32 = [t.to(torch.float32).contiguous() for t in (q, k, v, g, beta)]
    S = state.to(STATE_DTYPE).contiguous()
    P = 0 if held is None else held.k.shape[0]
    if P:
        hk = held.k.to(torch.float32).contiguous()
        hu, hg = held.u.to(STATE_DTYPE).contiguous(), held.gamma.to(STATE_DTYPE).contiguous()
        hanc = held_ancestors.to(torch.uint8).contiguous()
    else:
        hk = torch.zeros(1, dtype=torch.float32)
        hu = hg = torch.zeros(1, dtype=STATE_DTYPE)
        hanc = torch.zeros(1, dtype=torch.uint8)
    anc = ancestors.to(torch.uint8).contiguous()
    o = torch.empty(N, HV, dv, dtype=STATE_DTYPE)
    u = torch.empty(N, HV, dv, dtype=STATE_DTYPE)
    gamma = torch.empty(N, HV, dtype=STATE_DTYPE)
    rc = lib.outrider_delta_tree(HV, dk, dv, N, P, _ptr(S), *map(_ptr, f32), _ptr(anc), _ptr(hanc), _ptr(hk),
                                 _ptr(hu), _ptr(hg), _ptr(o), _ptr(u), _ptr(gamma), torch.get_num_threads())
    if rc != 0:
        raise MemoryError("the native gated-delta step could not allocate its work buffer")
    return o, Stash(k=f32[1], u=u, gamma=gamma)


def fold_into(state: torch.Tensor, path: Stash) -> None:
    """gated_delta.fold written into `state` ([HV, dk, dv] float64, contiguous) in place."""
    if path.k.shape[0] == 0:
        return
    HV, dk, dv = state.shape
    assert state.dtype == STATE_DTYPE and state.is_contiguous()
    k = path.k.to(torch.float32).contiguous()
    u, gamma = path.u.to(STATE_DTYPE).contiguous(), path.gamma.to(STATE_DTYPE).contiguous()
    native.library().outrider_delta_fold(HV, dk, dv, k.shape[0], _ptr(state), _ptr(k), _ptr(u), _ptr(gamma),
                                         torch.get_num_threads())


def _fold_reference(state: torch.Tensor, path: Stash) -> None:
    state.copy_(gated_delta.fold(state, path))


@dataclass(frozen=True)
class DeltaOps:
    """Where a model's gated-delta state arithmetic runs: "native" (csrc/gated_delta.c) or "torch"
    (models/gated_delta.py, the reference; where the library is not built or config native is off)."""

    name: str
    tree_step: Callable
    fold_into: Callable  # (state [HV, dk, dv] float64, path Stash) -> None, in place

    @classmethod
    def choose(cls, device: torch.device | str = "cpu") -> "DeltaOps":
        if torch.device(device).type == "cpu" and native.available():
            return NATIVE
        return TORCH


NATIVE = DeltaOps("native", tree_step, fold_into)
TORCH = DeltaOps("torch", gated_delta.tree_step, _fold_reference)
