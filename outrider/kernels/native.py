"""Outrider's own CPU kernel for weights kept in GGUF blocks, built on first use.

    from outrider.kernels import native
    if native.available():
        y = native.qmatmul(x, blocks)     # x: float32 [M, in] -> [M, out], blocks: quant.QuantBlocks

`qmatmul.c` (beside this file) is compiled once per machine with the system C compiler
(`cc -O3 -march=native -ffp-contract=off -fopenmp`, about a second) into
`<cache_dir>/kernels/qmatmul-<key>.so`, the key a hash of the source, the flags, the
compiler and the CPU's flags, so an edited source or another machine builds its own. It is
loaded with ctypes (no Python extension API, no torch headers) after torch, so its OpenMP
regions run on torch's own libgomp with `torch.get_num_threads()` threads (passed on every call:
OpenMP's own setting is per calling thread, and a server's worker thread would otherwise get
every core). Where it cannot be built
(no compiler, not x86-64 with AVX2/FMA/F16C) or config `native` is off, `available()` is
False, one line on stderr says why when asked with `reason()`, and quantized weights use the
torch "blockwise" kernel instead: same values, slower.

Why a kernel of our own (docs/kernels.md, torch's kernels for quantized weights; measured:
docs/benchmarks/2026-11-30-intel-xeon-avx512-amx.md, Decoding and quantized weights):
torch's int4 CPU kernel is fast only with bfloat16 activations, and a bfloat16 model drifts from
its own autoregressive output under speculation; the float32 path through torch (dequantize
blocks, then a GEMM) runs at about half float32's speed. This kernel reads the 4-bit blocks once, decodes them in registers for up
to 8 rows of activations at once, and computes each output element by one fixed sequence of
float32 operations: results are bit-identical whatever the number of rows or threads (see the
C source), so a k-token verify forward gives each row exactly what a 1-token decode step gives.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import cache_dir, current, note_fact
from .blocks import BLOCK, QuantBlocks

CSRC = Path(__file__).with_name("csrc")
SOURCE = CSRC / "qmatmul.c"
SOURCES = (SOURCE, *(CSRC / f for f in ("decoder_layer.c", "attention.c", "matmul_amx.c", "qmatmul_i8.c",
                                       "qmatmul_i8_pack.c")))  # one library
HEADERS = tuple(CSRC / h for h in ("block_kinds.h", "block_decode.h", "qmatmul_i8.h", "attention.h"))  # in its key
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared")
KIND_CODES = {"q8_0": 0, "q4_0": 1, "q4_1": 2, "q8_16": 3}

_state: dict = {}  # "lib" (ctypes.CDLL) or "reason" (why not), decided once per process


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def cpu_vendor() -> str:
    """The CPU's vendor_id ("GenuineIntel", "AuthenticAMD", ...; "" where /proc/cpuinfo has none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def library_path(compiler: str) -> Path:
    """Where this source, built with these flags by this compiler for this CPU, is kept."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    texts = [s.read_text() for s in (*SOURCES, *HEADERS)]
    key = hashlib.sha256("\0".join([*texts, " ".join(FLAGS), version, _cpu_flags()]).encode())
    return cache_dir() / "kernels" / f"qmatmul-{key.hexdigest()[:16]}.so"


def _build(compiler: str, target: Path) -> None:
    """Compile into a temporary file beside `target`, then move it into place (atomic: test
    workers building at once each finish with a whole library)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.stem + ".", suffix=".so.tmp", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *FLAGS, "-o", tmp, *map(str, SOURCES)], capture_output=True, text=True,
                              timeout=120)
        if done.returncode != 0:
            raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "failed")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load() -> None:
    if not current().native:
        _state["reason"] = "config native is off (OUTRIDER_NATIVE=0)"
        return
    if platform.machine().lower() not in ("x86_64", "amd64"):
        _state["reason"] = f"it is written for x86-64 (AVX2), this is {platform.machine()}"
        return
    compiler = _compiler()
    if compiler is None:
        _state["reason"] = "no C compiler (cc) was found; install gcc to build it"
        return
    try:
        path = library_path(compiler)
        if not path.is_file():
            _build(compiler, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        _state["reason"] = f"building {SOURCE.name} failed: {err}"
        return
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.outrider_qmatmul.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, ptr, ptr, i64, ptr, ctypes.c_int]
    lib.outrider_qmatmul.restype = ctypes.c_int
    lib.outrider_qmatmul_rows.restype = ctypes.c_int
    lib.outrider_dequantize.argtypes = [ctypes.c_int, i64, ptr, ptr, ptr, i64, i64, ptr, ctypes.c_int]
    lib.outrider_dequantize.restype = ctypes.c_int
    lib.outrider_dequantize_bf16.argtypes = [ctypes.c_int, i64, ptr, ptr, ptr, i64, i64, ptr, ctypes.c_int]
    lib.outrider_dequantize_bf16.restype = ctypes.c_int
    f32 = ctypes.c_float
    lib.outrider_layer.argtypes = [i64, i64, i64, i64, i64, i64, ptr, ptr, ptr, ptr, f32, ptr, ptr, ptr, ptr, ptr, ptr,
                                   ptr, ptr, i64, i64, ptr, ptr, ptr, i64, ptr, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.outrider_layer.restype = ctypes.c_int
    lib.outrider_layers.argtypes = [i64, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, ptr, f32, ptr, ptr, i64,
                                    i64, ptr, ptr, ptr, i64, ptr, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.outrider_layers.restype = ctypes.c_int
    lib.outrider_amx_matmul.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, ptr, ptr, i64, ptr, ctypes.c_int, ctypes.c_int]
    lib.outrider_amx_matmul.restype = ctypes.c_int
    lib.outrider_amx_ok.restype = ctypes.c_int
    lib.outrider_i8_ok.restype = ctypes.c_int
    lib.outrider_i8_peak.argtypes = [i64, ctypes.c_int]
    lib.outrider_i8_peak.restype = ctypes.c_int
    lib.outrider_i8_row_bytes.argtypes = [ctypes.c_int, i64]
    lib.outrider_i8_row_bytes.restype = i64
    lib.outrider_i8_pack.argtypes = [ctypes.c_int, i64, ptr, ptr, ptr, i64, i64, ptr, ctypes.c_int]
    lib.outrider_i8_pack.restype = ctypes.c_int
    _state["lib"] = lib
    _state["path"] = path


def _ensure() -> None:
    if not _state:
        _load()
        note_fact("native", describe())


def available() -> bool:
    """Whether the kernel is built and loaded in this process (builds it on the first call)."""
    _ensure()
    return "lib" in _state


def reason() -> str:
    """Why the kernel is not available ("" when it is)."""
    _ensure()
    return _state.get("reason", "")


def rows_per_block() -> int:
    """Rows of activations each decoded block serves at once in this build (8 with AVX-512, 2 with AVX2)."""
    _ensure()
    return _state["lib"].outrider_qmatmul_rows() if "lib" in _state else 0


def supports(blocks: QuantBlocks) -> bool:
    return available() and blocks.device.type == "cpu" and blocks.kind in KIND_CODES


HALF = 4  # added to a kind code: its scales and mins are float16 (block_kinds.h)
FACTORED = 8  # added to q4_1 / q8_16: a K-quant's scales as the file keeps them (block_kinds.h)
LANES = 16  # added to a kind code: the weight packed for int8 activations (qmatmul_i8.c)


def i8_available() -> bool:
    """Whether qmatmul_i8.c's int8-activation kernel is built here (AVX-512 with VNNI): the `-i8` dtypes."""
    lib = library()
    return lib is not None and bool(lib.outrider_i8_ok())


@dataclass(frozen=True)
class NativeWeight:
    """One weight as the kernel reads it: the codes as GGUF keeps them, the scales and mins as
    GGUF keeps them too (float16: the kernel widens each once a block, exactly) or in float32
    where they are not float16 values (a K-quant's scales re-expressed: weights/quant_convert.py; q8_16).
    Float16 scales make a Q4_1 block 20 bytes instead of 24 and a Q8_0 block 34 instead of 36:
    the bytes a decode step streams."""

    kind: str
    shape: tuple[int, int]  # (out, in)
    q: torch.Tensor  # int8 [out, in] (q8_0, q8_16) or uint8 [out, in / 2] (q4_*); lanes: uint8 [out, row bytes]
    d: torch.Tensor  # float16 or float32 [out, in / 32] ([out, in / 16] for q8_16, float32), or FACTORED uint8 bytes
    m: torch.Tensor | None  # as d [out, in / 32] (q4_1; FACTORED: d itself)
    # qmatmul_i8.c's layout (codes and scales of 16 blocks a record, in q; d keeps only the scales'
    # dtype, no values): multiplied with x rounded to 8-bit blocks, the `-i8` dtypes' numerics
    lanes: bool = False

    @classmethod
    def of(cls, blocks: QuantBlocks) -> "NativeWeight":
        if blocks.factored is not None and blocks.kind in ("q4_1", "q8_16"):  # block_kinds.h FACTORED: fewer bytes
            f = blocks.factored.contiguous()
            return cls(blocks.kind, blocks.shape, blocks.q.contiguous(), f, f if blocks.kind == "q4_1" else None)
        half = blocks.kind != "q8_16" and blocks.d.dtype == torch.float16 and (
            blocks.m is None or blocks.m.dtype == torch.float16)
        dtype = torch.float16 if half else torch.float32
        m = blocks.m.to(dtype).contiguous() if blocks.m is not None else None
        return cls(blocks.kind, blocks.shape, blocks.q.contiguous(), blocks.d.to(dtype).contiguous(), m)

    @classmethod
    def packed(cls, blocks: QuantBlocks) -> "NativeWeight":
        """The blocks in qmatmul_i8.c's layout (the same codes and scales, regrouped: as many bytes),
        for the int8-activation kernel; needs `i8_available()`."""
        if not i8_available():
            raise RuntimeError("the int8-activation kernel needs AVX-512 with VNNI, which this CPU or build lacks")
        w = cls.of(blocks)
        out_features, in_features = w.shape
        lib = _state["lib"]
        row = lib.outrider_i8_row_bytes(w.code, in_features)
        q = torch.empty(out_features, max(row, 0), dtype=torch.uint8)
        m = w.m.data_ptr() if w.m is not None else None
        if row < 0 or lib.outrider_i8_pack(w.code, in_features, w.q.data_ptr(), w.d.data_ptr(), m, 0,
                                              out_features, q.data_ptr(), torch.get_num_threads()) != 0:
            raise ValueError(f"the int8-activation kernel does not take a {w.kind} weight {w.shape}")
        return cls(w.kind, w.shape, q, torch.empty(0, dtype=w.d.dtype), None, lanes=True)

    @property
    def code(self) -> int:
        """The kernel's kind code: KIND_CODES, plus HALF for float16 scales or FACTORED for a
        K-quant's factored ones (uint8 bytes), plus LANES for qmatmul_i8.c's layout."""
        extra = {torch.float16: HALF, torch.uint8: FACTORED}.get(self.d.dtype, 0)
        return KIND_CODES[self.kind] + extra + (LANES if self.lanes else 0)

    def tensors(self) -> list[torch.Tensor]:
        """The tensors it reads (a FACTORED q4_1's mins are its scales' bytes: counted once)."""
        if self.lanes:
            return [self.q]
        return [self.q, self.d] + ([self.m] if self.m is not None and self.m is not self.d else [])


def qmatmul(x: torch.Tensor, weight: "NativeWeight | QuantBlocks") -> torch.Tensor:
    """x: float32 [M, in] on the CPU -> float32 [M, out] = x @ dequantize(blocks).T, each row
    bit-identical whatever M (see the module docstring). Pass a NativeWeight made once (a
    QuantBlocks is converted on every call: for tests)."""
    if not available():
        raise RuntimeError(f"the native kernel is not available: {reason()}")
    if isinstance(weight, QuantBlocks):
        weight = NativeWeight.of(weight)
    out_features, in_features = weight.shape
    x = x.to(torch.float32).contiguous()
    if x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"x must be [rows, {in_features}], got {tuple(x.shape)}")
    y = torch.empty(x.shape[0], out_features, dtype=torch.float32)
    m = weight.m.data_ptr() if weight.m is not None else None
    status = _state["lib"].outrider_qmatmul(weight.code, x.data_ptr(), x.shape[0], in_features,
                                            weight.q.data_ptr(), weight.d.data_ptr(), m, out_features,
                                            y.data_ptr(), torch.get_num_threads())
    if status != 0:
        raise ValueError(f"the native kernel refused a {weight.kind} weight {weight.shape}")
    return y


AMX_ROWS = 1024  # rows matmul_amx.c takes a call (amx_matmul splits more)


def amx_available() -> bool:
    """Whether matmul_amx.c's tile kernel runs here: built with the AMX tile unit, and the OS lets this
    process use it (asked once)."""
    lib = library()
    return lib is not None and bool(lib.outrider_amx_ok())


def amx_matmul(x: torch.Tensor, weight: NativeWeight, lossy_bf16: bool = False) -> torch.Tensor | None:
    """x: float32 [M, in] -> float32 [M, out] on the tile unit with exact products and float32 sums
    (matmul_amx.c: for a prefill's many rows); None where it cannot (no AMX, out not a multiple of 16),
    for the caller's float GEMM. `lossy_bf16`: x rounded to bfloat16 (one part, not three; the
    codes stay exact): for a drafter's prefill, whose numerics change only its proposals."""
    if not amx_available():
        return None
    out_features, in_features = weight.shape
    x = x.to(torch.float32).contiguous()
    y = torch.empty(x.shape[0], out_features, dtype=torch.float32)
    m = weight.m.data_ptr() if weight.m is not None else None
    for start in range(0, x.shape[0], AMX_ROWS):
        rows = x[start : start + AMX_ROWS]
        status = _state["lib"].outrider_amx_matmul(weight.code, rows.data_ptr(), rows.shape[0], in_features,
                                                    weight.q.data_ptr(), weight.d.data_ptr(), m, out_features,
                                                    y[start:].data_ptr(), torch.get_num_threads(),
                                                    1 if lossy_bf16 else 3)
        if status != 0:
            return None
    return y


def dequantize_rows(weight: NativeWeight, start: int, stop: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Weight rows start..stop as [stop - start, in] of `dtype`: float32, the values the kernel
    multiplies with (quant.dequantize's exactly), for a float GEMM over many rows at once; or
    bfloat16, those values rounded as torch rounds them (AVX-512 builds; else via float32)."""
    if not available():
        raise RuntimeError(f"the native kernel is not available: {reason()}")
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dequantize_rows gives float32 or bfloat16, not {dtype}")
    out_features, in_features = weight.shape
    if not 0 <= start <= stop <= out_features:
        raise ValueError(f"rows {start}..{stop} are not within 0..{out_features}")
    out = torch.empty(stop - start, in_features, dtype=dtype)
    m = weight.m.data_ptr() if weight.m is not None else None
    call = _state["lib"].outrider_dequantize if dtype == torch.float32 else _state["lib"].outrider_dequantize_bf16
    status = call(weight.code, in_features, weight.q.data_ptr(), weight.d.data_ptr(), m, start, stop,
                  out.data_ptr(), torch.get_num_threads())
    if status != 0:
        if dtype == torch.bfloat16:  # a build without AVX-512
            return dequantize_rows(weight, start, stop).to(torch.bfloat16)
        raise ValueError(f"the native kernel refused to dequantize a {weight.kind} weight {weight.shape}")
    return out


def library():
    """The loaded ctypes library (kernels/decoder_layer.py calls its outrider_layer); None when unavailable."""
    _ensure()
    return _state.get("lib")


def describe() -> str:
    """One line: the kernel's state here (`outrider models list` prints it on stderr)."""
    if available():
        i8 = "int8 activations (the -i8 dtypes)" if i8_available() else "no int8 activations (no AVX-512 VNNI)"
        return f"native kernel {_state['path'].name} ({rows_per_block()} rows a block; {i8})"
    return f"native kernel unavailable: {reason()}"


assert BLOCK == 32, "qmatmul.c hard-codes 32-value blocks"
