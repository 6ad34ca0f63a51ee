"""The weight-only quantized linear: x [rows, in] times a weight kept in GGUF blocks -> [rows, out].

    w = QuantLinear(quantize(weight, "q4_1"))              # exact: the "blockwise" kernel
    w = QuantLinear(blocks, kernel=choose_kernel(blocks))  # exact: "native" where it builds
    w = QuantLinear(blocks, kernel=choose_kernel(blocks, fast=True))   # torch's int4 kernel, bf16
    y = w.linear(x)                                         # x: [..., in] -> [..., out]
    reference_linear(x, blocks)                             # the plain path: dequantize, then x @ w.T

Kernels (one per weight, chosen when it is built):

- "native" (any kind on a CPU where a C compiler is found; the default where it builds): Outrider's
  own C kernel (`csrc/qmatmul.c`, in the library variant the CPU runs best: AVX-512, AVX2 or plain
  C; kernels/native.py), float32 activations, reading the blocks as they are and decoding each in
  registers once for up to 8 rows. Its weight values are the reference's exactly, and
  each output row is bit-identical whatever the number of rows or threads, so a k-token verify
  forward's linears give each row what a 1-token step gives. Faster than float32 weights at one
  row (docs/benchmarks/2026-11-30-intel-xeon-avx512-amx.md, Decoding and
  quantized weights; `scripts/bench_quant_kernels.py` times the kernel alone).
- "blockwise" (any kind, any device; where "native" is not built or the compute dtype is not
  float32): dequantize a few hundred rows at a time into
  the compute dtype (codes * scale + offset, exactly the reference's values) and multiply with
  the float GEMM, so no full float copy ever exists. In float32 it differs from the reference only
  in summation order, like the float32 model does between a 1-token and a k-token forward: greedy
  speculative output stays equal to autoregressive output. Device-agnostic torch (the path on CUDA
  and MPS too; not run on a GPU here). Slower than a float32 matmul on the CPUs measured
  (docs/benchmarks/2026-11-30-intel-xeon-avx512-amx.md, Verify cost: "The CPU linear path").
- "int4pack" (Q4_0, Q4_1 on an x86 CPU, fast=True): torch's packed int4 kernel,
  `_weight_int4pack_mm_for_cpu`, group 32. It computes w = (code - 8) * scale + zero per group
  (tests/test_quant.py checks the formula), so Q4_0 maps onto it with scale d, zero 0, and Q4_1
  (w = d q + m) with scale d, zero m + 8 d. Needs `out` a multiple of 16.
- "int4pair" (Q8_0 on an x86 CPU, fast=True): a Q8_0 code q in -128..127 is 16 h + l with
  h = q >> 4 in -8..7 and l = q & 15, so a Q8_0 block is two 4-bit blocks: codes h + 8 with scale
  16 d and zero 0, codes l with scale d and zero 8 d. The same int4 kernel runs once over [x, x]
  against [high | low] (`in` doubled): Q8_0's own blocks, not quantized again. torch's int8 kernel
  (`_weight_int8pack_mm`) takes one scale per output row, which Q8_0's 32-value blocks do not map
  onto without quantizing again (a different model), so it is not used.

Precision of the int4 kernels: torch's CPU kernel is vectorized for bfloat16 activations only
(torch 2.13: float32 activations take a slow path, slower than a float32 matmul; docs/kernels.md,
torch's kernels for quantized weights), so x goes in as bfloat16, scales and zeros are bfloat16,
products are summed in float32 and the result comes out as bfloat16. Each rounding is at most 2**-8 relative (llama.cpp's CPU
path rounds activations to 8-bit blocks, the same order). The kernel itself is row-independent,
but its bfloat16 rounding turns the float32 attention's tiny differences between a 1-token and a
k-token forward (SDPA is not bit-identical across batch shapes) into differences of a bfloat16
step, and greedy speculative output then drifts from autoregressive output (seen on SmolLM2).
So it is opt-in ("q4-bf16-lossy", "q8_0-bf16-lossy") until attention is made row-invariant.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.nn.functional as F

from ..config import note_kernel
from . import cpu_linear, dispatch, native
from .dispatch import Product
from .blocks import BLOCK, GROUP, QuantBlocks, dequantize

_CHUNK_VALUES = 1 << 16  # blockwise: values dequantized at a time (256 KB of float32: stays in cache)


def reference_linear(x: torch.Tensor, blocks: QuantBlocks) -> torch.Tensor:
    """x: [rows, in] -> [rows, out]: dequantize the whole weight, then x @ w.T (float32)."""
    return x.float() @ dequantize(blocks).float().T


# torch's int4 CPU kernel is vectorized on x86 (AVX2, AVX512); elsewhere it is a slow scalar loop
_INT4_OP = hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")  # vectorised where dispatch.Plan.int4_fast
_INT4_DTYPE = torch.bfloat16  # the activations the int4 kernel is fast with (see the docstring)


def _int4pack_ok(blocks: QuantBlocks) -> bool:
    return (_INT4_OP and dispatch.plan().int4_fast and blocks.device.type == "cpu" and blocks.shape[0] % 16 == 0
            and blocks.kind in ("q8_0", "q4_0", "q4_1"))


def choose_kernel(blocks: QuantBlocks, fast: bool = False, dtype: torch.dtype = torch.float32,
                  i8: bool = False) -> str:
    """The kernel a weight gets on its device: "native" where it builds, else "blockwise" (both
    float32, exact values), or with `fast` torch's int4 kernel in bfloat16 where it is vectorized
    (see the module docstring); with `i8`, "i8" (int8 activations: the caller checks
    native.i8_available())."""
    if i8:
        return "i8"
    if fast and _int4pack_ok(blocks):
        return "int4pair" if blocks.kind == "q8_0" else "int4pack"
    return "native" if dtype == torch.float32 and native.supports(blocks) else "blockwise"


class QuantLinear:
    """A projection weight [out, in] kept quantized; `linear(x, bias)` is its matmul.

    dtype: the compute dtype (activations in, results out). `kernel`: one of "native",
    "blockwise", "int4pack", "int4pair" (see `choose_kernel`); by default "blockwise". Only the kernel's own
    form of the weight is kept.
    """

    def __init__(self, blocks: QuantBlocks, dtype: torch.dtype = torch.float32, kernel: str | None = None):
        self.kind = blocks.kind
        self.shape = blocks.shape  # (out, in)
        self.dtype = dtype
        self.device = blocks.device
        self.kernel = kernel or "blockwise"
        if self.kernel not in _PREPARE:
            raise ValueError(f"kernel must be one of {', '.join(_PREPARE)}, got {self.kernel!r}")
        if self.kernel in ("native", "i8") and not native.supports(blocks):
            raise ValueError(f"kernel {self.kernel} does not take a {self.kind} weight on {self.device}: "
                             f"{native.reason() or 'not a CPU tensor'}; use blockwise")
        if self.kernel not in ("blockwise", "native", "i8") and self.kernel != choose_kernel(blocks, fast=True):
            raise ValueError(f"kernel {self.kernel} does not take a {self.kind} weight {self.shape} on "
                             f"{self.device}: use {choose_kernel(blocks, fast=True)}")
        self.state = _PREPARE[self.kernel](blocks, dtype)
        note_kernel(f"{KERNEL_NAMES[self.kernel]} [{self.kind}]")

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x: [..., in] -> [..., out] in `dtype`."""
        flat = x.reshape(-1, self.shape[1]).contiguous()  # [M, in]
        out = _MATMUL[self.kernel](flat, self.state).to(self.dtype)  # [M, out]
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], self.shape[0])

    def nbytes(self) -> int:
        """Bytes of the weight as this kernel keeps it (what a forward reads)."""
        if self.kernel in ("native", "i8"):
            tensors = self.state["weight"].tensors()
        else:
            tensors = [t for t in self.state.values() if isinstance(t, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors)

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


# -- native: Outrider's C kernel ---------------------------------------------------------------------

# A forward that only fills the cache (a prompt's prefill: no logits, every row a prompt token)
# may multiply its many rows otherwise than decode rows: which way is the CPU's rule
# (kernels/dispatch.py Plan.product, with the reasons and the measurements behind each). On the
# AMX tile unit, matmul_amx.c (exact products, float32 sums); on Intel CPUs, the float GEMM on
# dequantized rows (`gemm_prefill`: its results differ from the kernel's in summation order,
# which nothing compares: autoregressive decoding and speculation prefill a prompt alike, and
# every decode and verify row still goes through the kernel, bit-identical whatever the number
# of rows). Lossy and opt-in (config lossy_bf16_prefill, CPUs with AMX): the GEMM in bfloat16 (x
# and the weight rows rounded, float32 sums), so the prompt's K/V carry bfloat16 rounding; every
# method prefills alike, so greedy speculative output still equals greedy autoregressive output
# under the same setting. A draft model's prefill (`filling(bf16=True)`,
# Decoder.drafter_prefill_bf16) takes bfloat16 wherever the CPU has AMX: a drafter's numerics
# change only what it proposes, never what is committed. Which path when: docs/kernels.md,
# Prefill paths. The speed and error of each (scripts/bench_fill.py), TILE_ROWS's and
# BULK_ROWS_BF16's measurements: docs/benchmarks/2026-11-30-intel-xeon-avx512-amx.md, Prefill.
_FILLING = contextvars.ContextVar("outrider_filling", default=False)
_BULK_VALUES = 1 << 20  # weight values dequantized at a time (4 MB of float32: measured best of 2**18-2**22)


@contextlib.contextmanager
def filling(on: bool = True, bf16: bool = False):
    """Within: linears take a filling forward's products (dispatch.Plan.product); with `bf16` (a
    drafter's prefill) the bfloat16 GEMM wherever the CPU has AMX, asked for or not."""
    token = _FILLING.set("bf16" if on and bf16 else on)
    try:
        yield
    finally:
        _FILLING.reset(token)


def _prepare_native(blocks: QuantBlocks, dtype: torch.dtype) -> dict:
    if dtype != torch.float32:
        raise ValueError(f"kernel native computes in float32, not {dtype}; use blockwise")
    return {"weight": native.NativeWeight.of(blocks)}


def _matmul_native(x: torch.Tensor, state: dict) -> torch.Tensor:
    weight = state["weight"]
    fill = _FILLING.get()
    if not fill:
        return native.qmatmul(x, weight)
    plan, drafter = dispatch.plan(), fill == "bf16"
    how = plan.product(x.shape[0], drafter=drafter)
    if how is Product.TILES:
        y = native.amx_matmul(x, weight, lossy_bf16=plan.lossy_bf16 or (drafter and plan.drafter_bf16))
        if y is not None:  # None: a weight it does not take (out not a multiple of 16), or no tiles here
            note_kernel("matmul_amx.c (prefill)")
            return y
        how = plan.product(x.shape[0], drafter=drafter, tiles=False)
    if how is Product.KERNEL:
        return native.qmatmul(x, weight)
    bf16 = how is Product.GEMM_BF16
    note_kernel("dequantize + torch GEMM (prefill" + (", lossy bfloat16)" if bf16 else ")"))
    out_features, in_features = weight.shape
    x = x.to(torch.bfloat16 if bf16 else torch.float32)
    step = max(16, _BULK_VALUES // in_features)
    out = torch.empty(x.shape[0], out_features)  # [M, out] float32
    for start in range(0, out_features, step):
        stop = min(start + step, out_features)
        w = native.dequantize_rows(weight, start, stop, x.dtype)  # [chunk, in]
        out[:, start:stop] = F.linear(x, w) if bf16 else cpu_linear.matmul(x, w, transient=True)
    return out


# -- i8: int8 activations (native/qmatmul_i8.c; kernels/qmatmul_i8_reference.py is its reference) ---------------------------

def _prepare_i8(blocks: QuantBlocks, dtype: torch.dtype) -> dict:
    if dtype != torch.float32:
        raise ValueError(f"kernel i8 takes float32 activations, not {dtype}")
    return {"weight": native.NativeWeight.packed(blocks)}


def _matmul_i8(x: torch.Tensor, state: dict) -> torch.Tensor:
    """Any number of rows through the one kernel (no GEMM path for a prefill: at many rows the
    integer products outrun the float GEMM, and a prompt's rows get the numerics of decode rows)."""
    return native.qmatmul(x, state["weight"])


# -- blockwise: any kind, any device ---------------------------------------------------------------

def _prepare_blockwise(blocks: QuantBlocks, dtype: torch.dtype) -> dict:
    """Codes one a byte [out, in / group, group] and per group scale and offset [out, in / group, 1],
    so that codes * scale + offset is the reference's value exactly: d q (Q8_0, q8_16), q d - 8 d =
    (q - 8) d (Q4_0: both terms and the result are exact in float32), d q + m (Q4_1, the same
    operations)."""
    out_features, in_features = blocks.shape
    group = GROUP[blocks.kind]
    codes = blocks.codes().view(out_features, in_features // group, group)
    d = blocks.d.float().unsqueeze(-1)  # [out, groups, 1]
    if blocks.kind in ("q8_0", "q8_16"):
        offset = None
    elif blocks.kind == "q4_0":
        offset = -8 * d
    else:
        offset = blocks.m.float().unsqueeze(-1)
    return {"codes": codes, "scale": d, "offset": offset, "dtype": dtype}


def _matmul_blockwise(x: torch.Tensor, state: dict) -> torch.Tensor:
    codes, scale, offset = state["codes"], state["scale"], state["offset"]
    x = x.to(state["dtype"])
    out_features, groups, group = codes.shape
    step = max(16, _CHUNK_VALUES // (groups * group))
    out = x.new_empty(x.shape[0], out_features)  # [M, out]
    for start in range(0, out_features, step):
        rows = slice(start, min(start + step, out_features))
        w = codes[rows] * scale[rows]  # [chunk, blocks, 32] float32
        if offset is not None:
            w += offset[rows]
        w = w.view(w.shape[0], -1).to(x.dtype)  # [chunk, in]
        out[:, rows] = cpu_linear.matmul(x, w, transient=True) if x.device.type == "cpu" else F.linear(x, w)
    return out


# what `config.describe()` calls each kernel (the C file or torch op that does the products)
KERNEL_NAMES = {"native": "qmatmul.c", "i8": "qmatmul_i8.c", "int4pack": "torch int4pack (bfloat16)",
                "int4pair": "torch int4pack pair (bfloat16)", "blockwise": "torch blockwise"}
_PREPARE = {"native": _prepare_native, "int4pack": _prepare_int4pack, "int4pair": _prepare_int4pair,
            "blockwise": _prepare_blockwise, "i8": _prepare_i8}
_MATMUL = {"native": _matmul_native, "int4pack": _matmul_int4pack, "int4pair": _matmul_int4pair,
           "blockwise": _matmul_blockwise, "i8": _matmul_i8}
