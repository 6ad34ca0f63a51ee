"""A whole decoder layer in one native call, for forwards of a few rows (decoder_layer.c).

    layers = NativeLayers.of(decoder)        # None unless every layer's four matrices run natively
    x = layers.run(decoder, batch, cache, x, cos, sin, upto, hidden)   # x: [B, T, E] float32

Used by models/decoder.py for the forwards that ask for logits (decode steps, verify rounds,
draft steps) on a CPU, and for prefills where the CPU's rule takes it (kernels/dispatch.py
Plan.prefill: `fill` is the path's code: their products through matmul_amx.c from
dispatch.TILE_ROWS rows where the CPU has the AMX tile unit, the row and fill kernels elsewhere,
unless the rule keeps the torch path and its float GEMM for many rows). The torch layer (decoder.py) is the reference:
tests/test_native_layer.py compares the two, and checks that a row's result does not depend on
the other rows of its batch.

A mixture of experts (Qwen3-MoE, Qwen2-MoE, Mixtral: config.mlp_kinds) runs its attention here
and its MLP in torch: an MoE layer's call is attention only (decoder_layer.c with I = 0: x += attn
W_o^T), then its router and experts by moe_layer.moe_mlp (the rows grouped by expert, each chosen
expert's QuantLinear read once a forward) on rms_norm(x) and added to x in place; its dense
layers (mlp_only_layers, DeepSeek's first layers) stay whole native layers. One call a layer then,
not one a span. The MoE part is the torch layer's own code, so expert skip, expert selection, an
expert store and a draft expert act on it as on the torch layer. Its experts' QuantLinear products
take the row kernel, in a prefill too; its float router product (and Qwen2-MoE's shared gate) is
layers.linear's, whose bits follow the row count, as on the torch layer: a verify's rows equal
one-token steps within float rounding, not bit for bit (a router computed row by row would make
them so: left). The torch layer is the reference: tests/test_native_moe.py.

The scores option (`mass`, SparseSpec-L's selection): run() adds the attention weights each row
gave each key, summed over the query heads of a K/V head, into mass [N, layers, G, L] at the row's
entry (`mass_at`); the forward's outputs are the same bits with it or without it
(tests/test_native_scores.py).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from ..config import current
from .native import NativeWeight, library


class QWeight(ctypes.Structure):
    pass


QWeight._fields_ = [("kind", ctypes.c_int64), ("out", ctypes.c_int64), ("in_", ctypes.c_int64),
                    ("q", ctypes.c_void_p), ("d", ctypes.c_void_p), ("m", ctypes.c_void_p),
                    ("nparts", ctypes.c_int64), ("parts", ctypes.POINTER(QWeight))]  # a stack's parts (decoder_layer.c)


class AttentionMass(ctypes.Structure):  # attention.h: the scores option
    _fields_ = [("out", ctypes.c_void_p), ("at", ctypes.c_void_p), ("layers", ctypes.c_int64),
                ("layer", ctypes.c_int64)]


class KVPages(ctypes.Structure):  # attention.h: paged K/V read in place (models/paged_cache.py PagedKVCache.rows_in_place)
    _fields_ = [("rows", ctypes.c_void_p), ("map_stride", ctypes.c_int64), ("head_stride", ctypes.c_int64)]


class LayerSpec(ctypes.Structure):  # decoder_layer.c: what differs between layers
    _fields_ = [("in_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("qkv_bias", ctypes.c_void_p),
                ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p), ("w", ctypes.c_void_p)]


NATIVE_KERNELS = ("native", "i8")  # quant_linear kernels whose weights outrider_qmatmul takes


def _qweight(w: NativeWeight) -> QWeight:
    return QWeight(w.code, w.shape[0], w.shape[1], w.q.data_ptr(), w.d.data_ptr(),
                   w.m.data_ptr() if w.m is not None else None, 0, None)


def _native_weight(m) -> QWeight | None:
    """A native QuantLinear, or a RowStack (weights/quant_load.py) of them, as decoder_layer.c reads it; None otherwise.
    A stack's parts array rides on the QWeight (`_keep`) so it lives as long as it."""
    if getattr(m, "kernel", None) in NATIVE_KERNELS:
        return _qweight(m.state["weight"])
    parts = getattr(m, "parts", None)
    if not parts or not all(getattr(p, "kernel", None) in NATIVE_KERNELS for p in parts):
        return None
    array = (QWeight * len(parts))(*[_qweight(p.state["weight"]) for p in parts])
    first = parts[0].state["weight"]
    stack = QWeight(-1, sum(p.state["weight"].shape[0] for p in parts), first.shape[1], None, None, None,
                    len(parts), ctypes.cast(array, ctypes.POINTER(QWeight)))
    stack._keep = array
    return stack


def enabled() -> bool:
    """False when config native_layer is off (the torch layer everywhere: the reference, a baseline)."""
    return current().native_layer


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


@dataclass
class NativeLayers:
    weights: list  # per layer: (QWeight * 4) array (qkv, o, gate_up, down); their tensors stay alive in the decoder
    specs: ctypes.Array  # (LayerSpec * layers): each layer's weights and norms, for outrider_layers
    # every matrix in qmatmul_i8.c's int8-activation layout: the row kernel is then the fast path at
    # any number of rows, a prefill's too (dispatch.Plan.prefill)
    lanes: bool = False
    moe: tuple = ()  # per layer: its MLP a mixture of experts, run in torch after a native attention-only call

    @staticmethod
    def matrices(mats: list) -> "ctypes.Array | None":
        """(QWeight * 4) for [qkv, o, gate_up, down], or None unless all four are native QuantLinears
        (or stacks of them)."""
        found = [_native_weight(m) for m in mats]
        if any(w is None for w in found):
            return None
        array = (QWeight * 4)(*found)  # copies the structs: the stacks' parts arrays ride along
        array._keep = [w._keep for w in found if hasattr(w, "_keep")]
        return array

    @classmethod
    def of(cls, decoder) -> "NativeLayers | None":
        """The layers' matrices as the kernel reads them, or None when any is not a native
        QuantLinear (a float model, another kernel), or the model is not float32 on a CPU."""
        if not enabled() or library() is None or decoder.device.type != "cpu" or decoder.dtype != torch.float32:
            return None
        c = decoder.config
        # kinds decoder_layer.c does not run: other mixers, partial rotary, the output gate, q/k norms
        # over the whole projection (OLMoE); MoE MLPs run in torch after an attention-only call
        if c.layer_kinds or c.rotary != c.head_dim or c.attn_output_gate or c.qk_norm_whole:
            return None
        moe = tuple(w.moe is not None for w in decoder.layers)
        arrays = [cls.attention_only([w.qkv, w.o]) if m else cls.matrices([w.qkv, w.o, w.gate_up, w.down])
                  for w, m in zip(decoder.layers, moe)]
        if not c.plain_block or any(a is None for a in arrays):  # Gemma 3's windows, sandwich norms ...: torch layers
            return None
        specs = (LayerSpec * len(arrays))(*[
            LayerSpec(_ptr(w.input_norm), _ptr(w.post_norm), _ptr(w.qkv_bias), _ptr(w.q_norm), _ptr(w.k_norm),
                      ctypes.addressof(a)) for w, a in zip(decoder.layers, arrays)])
        mats = [m for w in decoder.layers for m in (
            (w.qkv, w.o, *w.moe.gate_up, *w.moe.down) if w.moe is not None else (w.qkv, w.o, w.gate_up, w.down))]
        kernels = [getattr(p, "kernel", None) for m in mats for p in getattr(m, "parts", [m])]
        return cls(arrays, specs, lanes=all(k == "i8" for k in kernels), moe=moe if any(moe) else ())

    @staticmethod
    def attention_only(mats: list) -> "ctypes.Array | None":
        """(QWeight * 4) for an MoE layer's [qkv, o] (its MLP is torch's: decoder_layer.c with I = 0
        reads no gate_up or down), or None unless both are native."""
        found = [_native_weight(m) for m in mats]
        if any(w is None for w in found):
            return None
        array = (QWeight * 4)(*found, QWeight(), QWeight())
        array._keep = [w._keep for w in found if hasattr(w, "_keep")]
        return array

    def run(self, decoder, batch, cache, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, upto: int,
            hidden: dict, *, fill: int = 0, mass: torch.Tensor | None = None,
            mass_at: torch.Tensor | None = None, pages: "KVPages | None" = None) -> torch.Tensor:
        """Layers 0..upto-1 over x [B, T, E] (a new tensor, updated in place); the K/V of the
        batch's rows go to `cache` as decoder.forward writes them; hidden[l] gets a copy of x
        after layer l for l in batch.hidden_layers. One native call for the layers between two
        taps (`run_one` below is the call a layer). fill: 0, the row kernel; 3 or 1, a prefill's
        products on the tile unit (decoder_layer.c's matmul; dispatch.PrefillPath.fill). mass [N, upto, G, L] float32 (zeroed
        by the caller), mass_at [B * T] long (a row's entry, -1: not counted): the scores option.
        pages: a paged cache's rows read in place (the batch's slots and rows as
        PagedKVCache.rows_in_place gave them); None: a slot cache."""
        c = decoder.config
        call = LayerCall(batch, cache, x, cos, sin, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
                         fill=fill, mass=mass, mass_at=mass_at, pages=pages)
        if self.moe:  # a mixture of experts: a call a layer, its MLP in torch between them
            return self._layers(decoder, call, upto, hidden)
        k_caches = (ctypes.c_void_p * upto)(*[t.data_ptr() for t in cache.k[:upto]])
        v_caches = (ctypes.c_void_p * upto)(*[t.data_ptr() for t in cache.v[:upto]])
        start = 0
        for stop in sorted({*(l for l in batch.hidden_layers if 0 < l < upto), upto}):
            call.run_span(start, stop, self.specs, k_caches, v_caches, c.rms_norm_eps)
            if stop > 0 and stop in batch.hidden_layers:  # hidden[0] (the embedding) is the caller's
                hidden[stop] = call.x.clone()
            start = stop
        return call.x

    def run_one(self, decoder, batch, cache, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, upto: int,
                hidden: dict, *, fill: int = 0, mass: torch.Tensor | None = None,
                mass_at: torch.Tensor | None = None) -> torch.Tensor:
        """`run`, one native call a layer (the reference for the span call; tests)."""
        c = decoder.config
        call = LayerCall(batch, cache, x, cos, sin, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
                         fill=fill, mass=mass, mass_at=mass_at)
        return self._layers(decoder, call, upto, hidden)

    def _layers(self, decoder, call: "LayerCall", upto: int, hidden: dict) -> torch.Tensor:
        """Layers 0..upto-1, one native call each; an MoE layer's (self.moe) attention only, then its
        MLP by moe_layer.moe_mlp, added to call.x in place."""
        from ..models.layers import rms_norm
        from ..models.moe_layer import moe_mlp

        c = decoder.config
        R, E = call.shape[:2]
        x = call.x.view(R, E)  # the native calls' x: updated in place
        for index in range(upto):
            w = decoder.layers[index]
            moe = bool(self.moe) and self.moe[index]
            call.run(index, self.weights[index], w.input_norm, w.post_norm, c.rms_norm_eps, w.qkv_bias, w.q_norm,
                     w.k_norm, attention_only=moe)
            if moe:  # [R, E]: the torch layer's MLP on the same rows, its products on the row kernel
                x.add_(moe_mlp(w.moe, c.moe, rms_norm(x, w.post_norm, c.rms_norm_eps)))
            if index + 1 in call.hidden_layers:
                hidden[index + 1] = call.x.clone()
        return call.x


class LayerCall:
    """The arguments of outrider_layer that one forward shares across its layers: the residual
    stream x [R, E] (a copy, updated in place), rotary tables, slots, cache rows, mask, workspace."""

    def __init__(self, batch, cache, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, H: int, G: int, D: int,
                 I: int, h_in: torch.Tensor | None = None, fill: int = 0, mass: torch.Tensor | None = None,
                 mass_at: torch.Tensor | None = None, pages: KVPages | None = None):
        B, T, E = x.shape
        self.fill = fill
        self.hidden_layers = batch.hidden_layers
        R, L = B * T, batch.kv_len
        self.shape, self.cache, self.L = (R, E, H, G, D, I), cache, L
        if cache.k[0].dtype not in (torch.float32, torch.float16):
            raise ValueError(f"the native layer reads a float32 or float16 K/V cache, not {cache.k[0].dtype}")
        self.kv_half = int(cache.k[0].dtype == torch.float16)  # the cache's values: float32, or float16
        self.x = x.clone(memory_format=torch.contiguous_format)  # the caller's x (hidden[0]) is kept
        self.h_in = None if h_in is None else h_in.reshape(R, -1).contiguous()  # [R, w[0].in], normed by the caller
        self.cos = cos.reshape(R, D).contiguous()  # [R, D]
        self.sin = sin.reshape(R, D).contiguous()
        self.slots = batch.slots.view(B, 1).expand(B, T).reshape(R).contiguous()  # [R] slot of each row
        self.rows = batch.rows.reshape(R).contiguous()  # [R] cache row of each token
        self.mask = None if batch.attn_mask is None else batch.attn_mask.reshape(R, L).contiguous()  # [R, L] bool
        self.work = torch.empty(R * ((H + 2 * G) * D + H * D + E + 3 * I) + R * H * (L + 8), dtype=torch.float32)
        # the pointers every layer's call shares, read once (~30 layers a forward, a few µs each)
        self._x, self._h_in, self._mask = self.x.data_ptr(), _ptr(self.h_in), _ptr(self.mask)
        self._rope = (self.cos.data_ptr(), self.sin.data_ptr())
        self._rows = (self.slots.data_ptr(), self.rows.data_ptr())
        self._work = self.work.data_ptr()
        self._pages = None if pages is None else ctypes.byref(pages)  # paged K/V read in place, or a slot cache
        self.mass = None  # the scores option: AttentionMass over mass [N, layers, G, L], mass_at [R]
        if mass is not None:
            if mass.dtype != torch.float32 or not mass.is_contiguous() or mass.shape[-1] != L or mass_at is None:
                raise ValueError("the scores option takes a contiguous float32 [N, layers, G, kv_len] and each row's entry")
            self.mass_at = mass_at.reshape(R).to(torch.int64).contiguous()  # [R]
            self.mass = AttentionMass(mass.data_ptr(), self.mass_at.data_ptr(), mass.shape[1], 0)

    def run(self, index: int, weights, input_norm, post_norm, eps: float, qkv_bias=None, q_norm=None,
            k_norm=None, attention_only: bool = False) -> None:
        """Layer `index` of the cache with `weights` ((QWeight * 4)); updates self.x (attention_only:
        x += its attention's output, no MLP: an MoE layer's, NativeLayers._layers)."""
        R, E, H, G, D, I = self.shape
        I = 0 if attention_only else I
        k, v = self.cache.k[index], self.cache.v[index]
        status = library().outrider_layer(
            R, E, H, G, D, I, self._x, self._h_in, _ptr(input_norm), post_norm.data_ptr(), eps,
            weights, _ptr(qkv_bias), _ptr(q_norm), _ptr(k_norm), *self._rope,
            k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(2), *self._rows,
            self._mask, self.L, self._work, torch.get_num_threads(), self.fill, self.kv_half, self._mass(index),
            self._pages)
        if status != 0:
            raise ValueError(f"the native layer refused layer {index} (R={R}, L={self.L})")

    def run_span(self, start: int, stop: int, specs, k_caches, v_caches, eps: float) -> None:
        """Layers start..stop-1 in one call (specs, k/v_caches: per layer, NativeLayers.run)."""
        if stop <= start:
            return
        R, E, H, G, D, I = self.shape
        k = self.cache.k[start]
        status = library().outrider_layers(
            start, stop, specs, k_caches, v_caches, R, E, H, G, D, I, self._x, eps, *self._rope,
            k.stride(0), k.stride(2), *self._rows, self._mask, self.L, self._work, torch.get_num_threads(),
            self.fill, self.kv_half, self._mass(0), self._pages)
        if status != 0:
            raise ValueError(f"the native layer refused layers {start}..{stop - 1} (R={R}, L={self.L})")

    def _mass(self, layer: int):
        """The scores option's struct for a call whose first layer is `layer` (None: not asked)."""
        if self.mass is None:
            return None
        self.mass.layer = layer  # outrider_layers sets each layer's own
        return ctypes.byref(self.mass)
