"""A whole decoder layer in one native call, for forwards of a few rows (layer.c).

    layers = NativeLayers.of(decoder)        # None unless every layer's four matrices run natively
    x = layers.run(decoder, batch, cache, x, cos, sin, upto, hidden)   # x: [B, T, E] float32

Used by models/decoder.py for the forwards that ask for logits (decode steps, verify rounds,
draft steps) on a CPU: prefills keep the torch path (and its GEMM for many rows). The torch
layer (decoder.py) is the reference: tests/test_native_layer.py compares the two, and checks
that a row's result does not depend on the other rows of its batch.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from . import KIND_CODES, NativeWeight, library


class QWeight(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int64), ("out", ctypes.c_int64), ("in_", ctypes.c_int64),
                ("q", ctypes.c_void_p), ("d", ctypes.c_void_p), ("m", ctypes.c_void_p)]


def _qweight(w: NativeWeight) -> QWeight:
    return QWeight(KIND_CODES[w.kind], w.shape[0], w.shape[1], w.q.data_ptr(), w.d.data_ptr(),
                   w.m.data_ptr() if w.m is not None else None)


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


@dataclass
class NativeLayers:
    weights: list  # per layer: (QWeight * 4) array (qkv, o, gate_up, down); their tensors stay alive in the decoder

    @classmethod
    def of(cls, decoder) -> "NativeLayers | None":
        """The layers' matrices as the kernel reads them, or None when any is not a native
        QuantLinear (a float model, another kernel), or the model is not float32 on a CPU."""
        if library() is None or decoder.device.type != "cpu" or decoder.dtype != torch.float32:
            return None
        arrays = []
        for w in decoder.layers:
            mats = [w.qkv, w.o, w.gate_up, w.down]
            if not all(getattr(m, "kernel", None) == "native" for m in mats):
                return None
            arrays.append((QWeight * 4)(*[_qweight(m.state["weight"]) for m in mats]))
        return cls(arrays)

    def run(self, decoder, batch, cache, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, upto: int,
            hidden: dict) -> torch.Tensor:
        """Layers 0..upto-1 over x [B, T, E] (a new tensor, updated in place); the K/V of the
        batch's rows go to `cache` as decoder.forward writes them; hidden[l] gets a copy of x
        after layer l for l in batch.hidden_layers."""
        c = decoder.config
        B, T, E = x.shape
        R, H, G, D, I = B * T, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
        L = batch.kv_len
        x = x.clone(memory_format=torch.contiguous_format)  # updated in place; the caller's x (hidden[0]) kept
        cos = cos.reshape(R, D).contiguous()  # [R, D]
        sin = sin.reshape(R, D).contiguous()
        slots = torch.tensor(batch.slot_ids, dtype=torch.long).view(B, 1).expand(B, T).reshape(R).contiguous()
        rows = batch.rows.reshape(R).contiguous()  # [R] cache row of each token
        mask = None if batch.attn_mask is None else batch.attn_mask.reshape(R, L).contiguous()  # [R, L] bool
        work = torch.empty(R * ((H + 2 * G) * D + H * D + E + 3 * I) + R * H * L, dtype=torch.float32)
        k0 = cache.k[0]
        slot_stride, row_stride = k0.stride(0), k0.stride(2)
        lib, threads, eps = library(), torch.get_num_threads(), c.rms_norm_eps
        for index in range(upto):
            w = decoder.layers[index]
            k, v = cache.k[index], cache.v[index]
            status = lib.outrider_layer(R, E, H, G, D, I, x.data_ptr(), w.input_norm.data_ptr(),
                                        w.post_norm.data_ptr(), eps, self.weights[index], _ptr(w.qkv_bias),
                                        _ptr(w.q_norm), _ptr(w.k_norm), cos.data_ptr(), sin.data_ptr(),
                                        k.data_ptr(), v.data_ptr(), slot_stride, row_stride, slots.data_ptr(),
                                        rows.data_ptr(), _ptr(mask), L, work.data_ptr(), threads)
            if status != 0:
                raise ValueError(f"the native layer refused layer {index} (R={R}, L={L})")
            if index + 1 in batch.hidden_layers:
                hidden[index + 1] = x.clone()
        return x
