"""The weight-only quantized linear: x [rows, in] times a weight kept in GGUF blocks -> [rows, out].

    w = QuantLinear(quantize(weight, "q4_1"))      # or blocks read from a GGUF
    y = w.linear(x)                                 # x: [..., in] -> [..., out]; what layers.linear calls
    reference_linear(x, blocks)                     # the slow, plain path: dequantize, then x @ w.T

Each weight goes through one kernel, chosen once when it is built (`choose_kernel`):

- "int4pack" (Q4_0, Q4_1 on an x86 CPU): torch's packed int4 kernel, `_weight_int4pack_mm_for_cpu`,
  group 32. It computes w = (code - 8) * scale + zero per group (tests/test_quant.py checks the
  formula), so Q4_0 maps onto it with scale d, zero 0, and Q4_1 (w = d q + m) with scale d,
  zero m + 8 d. Needs `out` a multiple of 16.
- "int4pair" (Q8_0 on an x86 CPU): a Q8_0 code q in -128..127 is 16 h + l with h = q >> 4 in -8..7
  and l = q & 15, so a Q8_0 block is two 4-bit blocks: codes h + 8 with scale 16 d and zero 0,
  codes l with scale d and zero 8 d. The same int4 kernel runs once over [x, x] against
  [high | low] (`in` doubled): Q8_0's own blocks, not quantized again. torch's int8 kernel
  (`_weight_int8pack_mm`) takes one scale per output row, which Q8_0's 32-value blocks do not
  map onto without quantizing again (a different model), so it is not used.
- "blockwise" (any kind, any device; the fallback): dequantize a few hundred rows at a time into
  the compute dtype and multiply, so no full float copy ever exists. The path on CUDA and MPS
  (device-agnostic torch; not run on a GPU here), on CPUs without AVX2, and for shapes the int4
  kernel refuses. In float32 it is exact up to the summation order.

Precision of the int4 kernels: torch's CPU kernel is vectorized for bfloat16 activations only
(measured with torch 2.13: float32 activations take a path 17x slower at one row, slower than a
float32 matmul), so x goes in as bfloat16, the scales and zeros are bfloat16, products are summed
in float32 and the result comes out as bfloat16 (then cast back to the compute dtype). Each of
those roundings is at most 2**-8 relative: the same order as llama.cpp's CPU path, which rounds
activations to 8-bit blocks for its dot products. The kernel is row-independent (a row's result
does not depend on the other rows in the call), so a k-token verify gives one-token decode's
numbers bit for bit, which greedy speculative decoding relies on.
"""

from __future__ import annotations

import torch

from .layers import linear as float_linear
from .quant import BLOCK, QuantBlocks, dequantize

_CHUNK_VALUES = 1 << 16  # blockwise: values dequantized at a time (256 KB of float32: stays in cache)


def reference_linear(x: torch.Tensor, blocks: QuantBlocks) -> torch.Tensor:
    """x: [rows, in] -> [rows, out]: dequantize the whole weight, then x @ w.T (float32)."""
    return x.float() @ dequantize(blocks).float().T


# torch's int4 CPU kernel is vectorized on x86 (AVX2, AVX512); elsewhere it is a slow scalar loop
_FAST_INT4 = (hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
              and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"))
_INT4_DTYPE = torch.bfloat16  # the activations the int4 kernel is fast with (see the docstring)


def _int4pack_ok(blocks: QuantBlocks) -> bool:
    return _FAST_INT4 and blocks.device.type == "cpu" and blocks.shape[0] % 16 == 0


def choose_kernel(blocks: QuantBlocks) -> str:
    """The kernel a weight gets on its device (see the module docstring)."""
    if _int4pack_ok(blocks):
        return "int4pair" if blocks.kind == "q8_0" else "int4pack"
    return "blockwise"


class QuantLinear:
    """A projection weight [out, in] kept quantized; `linear(x, bias)` is its matmul.

    dtype: the compute dtype (activations in, results out). `kernel` forces one kernel (tests);
    by default `choose_kernel`. Only the kernel's own form of the weight is kept.
    """

    def __init__(self, blocks: QuantBlocks, dtype: torch.dtype = torch.float32, kernel: str | None = None):
        self.kind = blocks.kind
        self.shape = blocks.shape  # (out, in)
        self.dtype = dtype
        self.device = blocks.device
        self.kernel = kernel or choose_kernel(blocks)
        if self.kernel not in _PREPARE:
            raise ValueError(f"kernel must be one of {', '.join(_PREPARE)}, got {self.kernel!r}")
        if self.kernel != "blockwise" and (not _int4pack_ok(blocks) or self.kernel != choose_kernel(blocks)):
            raise ValueError(f"kernel {self.kernel} does not take a {self.kind} weight {self.shape} on "
                             f"{self.device}: use {choose_kernel(blocks)} or blockwise")
        self.state = _PREPARE[self.kernel](blocks, dtype)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x: [..., in] -> [..., out] in `dtype`."""
        flat = x.reshape(-1, self.shape[1]).contiguous()  # [M, in]
        out = _MATMUL[self.kernel](flat, self.state).to(self.dtype)  # [M, out]
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], self.shape[0])

    def nbytes(self) -> int:
        """Bytes of the weight as this kernel keeps it (what a forward reads)."""
        tensors = self.state.values() if isinstance(self.state, dict) else [self.state]
        return sum(t.nbytes() if isinstance(t, QuantBlocks) else t.numel() * t.element_size() for t in tensors)

    def __repr__(self) -> str:
        return f"QuantLinear({self.kind}, {self.shape[0]}x{self.shape[1]}, {self.kernel})"


# -- int4pack: Q4_0 / Q4_1 ------------------------------------------------------------------------

def _pack_int4(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> dict:
    """codes: 0..15 [out, in]; scale, zero: float32 [out, in / 32] -> the kernel's form."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 2)  # uint8 [out, in/2]
    scales_and_zeros = torch.stack((scale, zero), dim=-1).transpose(0, 1)  # [in/32, out, 2]
    return {"packed": packed, "scales_and_zeros": scales_and_zeros.to(_INT4_DTYPE).contiguous()}


def _prepare_int4pack(blocks: QuantBlocks, dtype: torch.dtype) -> dict:
    d = blocks.d.float()
    zero = torch.zeros_like(d) if blocks.kind == "q4_0" else blocks.m.float() + 8 * d
    return _pack_int4(blocks.codes(), d, zero)


def _matmul_int4pack(x: torch.Tensor, state: dict) -> torch.Tensor:
    x = x.to(_INT4_DTYPE)  # [M, in]
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, state["packed"], BLOCK, state["scales_and_zeros"])


# -- int4pair: Q8_0 as two 4-bit halves --------------------------------------------------------------

def _prepare_int4pair(blocks: QuantBlocks, dtype: torch.dtype) -> dict:
    q = blocks.q  # int8 [out, in]
    high = (q >> 4).to(torch.int16) + 8  # 0..15: q = 16 (high - 8) + low
    low = q & 15  # 0..15 (two's complement: the low four bits)
    d = blocks.d.float()
    codes = torch.cat((high, low.to(torch.int16)), dim=1)  # [out, 2 in]: every high block, then every low
    scale = torch.cat((16 * d, d), dim=1)  # [out, 2 in / 32]
    zero = torch.cat((torch.zeros_like(d), 8 * d), dim=1)
    return _pack_int4(codes, scale, zero)


def _matmul_int4pair(x: torch.Tensor, state: dict) -> torch.Tensor:
    x = x.to(_INT4_DTYPE)
    doubled = torch.cat((x, x), dim=1)  # [M, 2 in]: the high half and the low half see the same x
    return torch.ops.aten._weight_int4pack_mm_for_cpu(doubled, state["packed"], BLOCK, state["scales_and_zeros"])


# -- blockwise: any kind, any device ---------------------------------------------------------------

def _prepare_blockwise(blocks: QuantBlocks, dtype: torch.dtype) -> QuantBlocks:
    return QuantBlocks(blocks.kind, blocks.q, blocks.d, blocks.m, dtype)


def _matmul_blockwise(x: torch.Tensor, blocks: QuantBlocks) -> torch.Tensor:
    x = x.to(blocks.dtype)
    out_features, in_features = blocks.shape
    step = max(16, _CHUNK_VALUES // in_features)
    out = x.new_empty(x.shape[0], out_features)  # [M, out]
    for start in range(0, out_features, step):
        rows = slice(start, min(start + step, out_features))
        out[:, rows] = float_linear(x, dequantize(blocks.rows(rows)))  # [M, chunk]
    return out


_PREPARE = {"int4pack": _prepare_int4pack, "int4pair": _prepare_int4pair, "blockwise": _prepare_blockwise}
_MATMUL = {"int4pack": _matmul_int4pack, "int4pair": _matmul_int4pair, "blockwise": _matmul_blockwise}
