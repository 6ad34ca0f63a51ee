"""Outrider's own CPU kernels for weights kept in GGUF blocks, built on first use, one library per
instruction set, the best the CPU runs chosen at run time.

    from outrider.kernels import native
    if native.available():
        y = native.qmatmul(x, blocks)     # x: float32 [M, in] -> [M, out], blocks: quant.QuantBlocks
    native.variant()                      # "avx512-vnni", "avx2", "portable", ...

The C sources beside this file (csrc/) are compiled (native_build.py) with the system C compiler into one library a
variant (`VARIANT_FLAGS`: `cc -O3 -ffp-contract=off -fopenmp` and the variant's instruction-set
flags, about 10-30 s of CPU the first time) kept in `<cache_dir>/kernels/qmatmul-<variant>-<key>.so`,
the key a hash of the sources, the flags, the compiler and the machine, so an edited source
builds its own. The variants, best first: amx (AVX-512 with VNNI, BF16, VBMI and the AMX tile
unit), avx512-vnni (the int8-activation kernel of the `-i8` dtypes on vpdpbusd), avx512 (x86-64-v4),
avx2 (x86-64-v3: AVX2, FMA, F16C; the `-i8` dtypes on vpmaddubsw, as avx512 too) and portable (plain
C, any CPU: ARM, older x86; no `-i8`). Config
`kernel_variant` ("auto": the best this CPU executes, config.kernel_variants_here) chooses; a
variant whose build fails is passed over for the next, its reason kept (`describe()`). Each is
loaded with ctypes (no Python extension API, no torch headers) after torch, so its OpenMP
regions run on torch's own libgomp with `torch.get_num_threads()` threads (passed on every call:
OpenMP's own setting is per calling thread, and a server's worker thread would otherwise get
every core). Where none can be built (no compiler) or config `native` is off, `available()` is
False, `reason()` says why, and quantized weights use the torch "blockwise" kernel instead: same
values, slower. `use_variant(name)` switches the loaded library within a process (the tests run
the kernels' tests against every variant the machine executes).

Why a kernel of our own (docs/kernels.md, torch's kernels for quantized weights; measured:
docs/benchmarks/2026-11-30-intel-xeon-avx512-amx.md, Decoding and quantized weights):
torch's int4 CPU kernel is fast only with bfloat16 activations, and a bfloat16 model drifts from
its own autoregressive output under speculation; the float32 path through torch (dequantize
blocks, then a GEMM) runs at about half float32's speed. This kernel reads the 4-bit blocks once, decodes them in registers for
up to 8 rows of activations at once, and computes each output element by one fixed sequence of
float32 operations: results are bit-identical whatever the number of rows or threads (see the
C source), so a k-token verify forward gives each row exactly what a 1-token decode step gives.
Two variants may differ from each other in the last bits (their sums' order).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
from dataclasses import dataclass

import torch

from ..config import current, kernel_variants_here, note_fact
from .blocks import BLOCK, QuantBlocks
from .native_build import SOURCE, VARIANT_RUNS, bind_entry_points, build_library, library_path, variant_flags  # noqa: F401  (re-exported)

KIND_CODES = {"q8_0": 0, "q4_0": 1, "q4_1": 2, "q8_16": 3}

# the library in use: "lib" (ctypes.CDLL), "path", "variant"; or "reason" (why none); "for": the
# (config native, variant asked) it was decided for, so a changed config or use_variant() decides again
_state: dict = {}
_loaded: dict[str, tuple] = {}  # variant -> (lib, path): every library loaded in this process
_failed: dict[str, str] = {}  # variant -> why its build or load failed (not tried again in this process)
_forced: list[str | None] = [None]  # use_variant()'s, over config kernel_variant


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _open(variant: str, compiler: str) -> tuple:
    """`variant`'s library, built if not yet in the cache, loaded once per process: (lib, path)."""
    if variant not in _loaded:
        path = library_path(compiler, variant)
        if not path.is_file():
            build_library(compiler, path, variant)
        lib = ctypes.CDLL(str(path))
        bind_entry_points(lib)
        _loaded[variant] = (lib, path)
    return _loaded[variant]


def asked() -> str:
    """The variant asked for: use_variant()'s, else config kernel_variant ("auto" or a name)."""
    return _forced[0] or current().kernel_variant


def _load(asked_for: str) -> None:
    _state.clear()
    _state["for"] = (current().native, asked_for)
    if not current().native:
        _state["reason"] = "config native is off (OUTRIDER_NATIVE=0)"
        return
    compiler = _compiler()
    if compiler is None:
        _state["reason"] = "no C compiler (cc) was found; install gcc to build it"
        return
    candidates = kernel_variants_here() if asked_for == "auto" else [asked_for]
    for variant in candidates:
        if variant in _failed:
            continue
        try:
            lib, path = _open(variant, compiler)
        except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as err:
            _failed[variant] = f"building {SOURCE.name} ({variant}) failed: {err}"
            continue
        _state.update(lib=lib, path=path, variant=variant)
        return
    _state["reason"] = "; ".join(_failed[v] for v in candidates if v in _failed) or "no variant to build"


def _ensure() -> None:
    if _state.get("for") != (current().native, asked()):
        _load(asked())
        note_fact("native", describe())
        note_fact("kernel_variant", _state.get("variant", "none"))


@contextlib.contextmanager
def use_variant(name: str):
    """Within: the library of variant `name` (built on first use; the config's choice is put back
    after). A ConfigError where this CPU cannot run it, as config kernel_variant gives."""
    if name != "auto" and name not in kernel_variants_here():
        current().replace(kernel_variant=name)  # raises the config's one-line refusal
    before = _forced[0]
    _forced[0] = name
    try:
        _ensure()
        yield name
    finally:
        _forced[0] = before
        _ensure()


def variant() -> str | None:
    """The variant whose library is in use (None when none is)."""
    _ensure()
    return _state.get("variant")


def available() -> bool:
    """Whether the kernel is built and loaded in this process (builds it on the first call)."""
    _ensure()
    return "lib" in _state


def reason() -> str:
    """Why the kernel is not available ("" when it is)."""
    _ensure()
    return _state.get("reason", "")


def rows_per_block() -> int:
    """Rows of activations each decoded block serves at most in this build (8 with AVX-512, 4 with AVX2:
    in groups of 3 and one of 4, qmatmul.c NEXT_ROWS; 4 portable)."""
    _ensure()
    return _state["lib"].outrider_qmatmul_rows() if "lib" in _state else 0


def supports(blocks: QuantBlocks) -> bool:
    return available() and blocks.device.type == "cpu" and blocks.kind in KIND_CODES


HALF = 4  # added to a kind code: its scales and mins are float16 (block_kinds.h)
FACTORED = 8  # added to q4_1 / q8_16: a K-quant's scales as the file keeps them (block_kinds.h)
LANES = 16  # added to a kind code: the weight packed for int8 activations (qmatmul_i8.c)


def i8_available() -> bool:
    """Whether an int8-activation kernel is built here: the `-i8` dtypes (qmatmul_i8.c with AVX-512 VNNI,
    qmatmul_i8_avx2.c with AVX2: every variant but portable)."""
    lib = library()
    return lib is not None and bool(lib.outrider_i8_ok())


def i8_avx_vnni(on: bool | None = None) -> bool:
    """Whether qmatmul_i8_avx2.c's integer sums take AVX-VNNI's 256-bit vpdpbusd (the CPU's `avx_vnni`:
    on by default where it has it) rather than vpmaddubsw, in the library in use: `on` False turns it
    off, True back on where the CPU has it, None only asks. The same bits either way; always False in
    the VNNI-512 and portable builds."""
    lib = library()
    return lib is not None and bool(lib.outrider_i8_avx_vnni(-1 if on is None else int(on)))


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
            raise RuntimeError("the int8-activation kernel needs AVX2 (the avx2 kernel variant or better), "
                               "which this CPU or build lacks")
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


PATHS = {"auto": 0, "rows": 1, "fill": 2}  # qmatmul's paths: the faster for M, the row kernel, qmatmul_fill.c


def fill_rows(kind: str = "q4_0") -> int:
    """The row count from which qmatmul's "auto" path takes qmatmul_fill.c for a weight of `kind`
    (the same bits either way; later for q8_0 and q8_16, whose blocks are cheap to decode)."""
    _ensure()
    return int(_state["lib"].outrider_fill_rows(KIND_CODES[kind])) if "lib" in _state else 0


@contextlib.contextmanager
def fill_rows_at(rows: int):
    """Within: the "auto" path takes qmatmul_fill.c from `rows` rows (a huge number: never), in
    every library loaded, for A/B timing (the same bits either way)."""
    libs = [lib for lib, _ in _loaded.values()]
    for lib in libs:
        lib.outrider_fill_rows_set(int(rows))
    try:
        yield
    finally:
        for lib in libs:
            lib.outrider_fill_rows_set(0)


def qmatmul(x: torch.Tensor, weight: "NativeWeight | QuantBlocks", path: str = "auto") -> torch.Tensor:
    """x: float32 [M, in] on the CPU -> float32 [M, out] = x @ dequantize(blocks).T, each row
    bit-identical whatever M (see the module docstring). Pass a NativeWeight made once (a
    QuantBlocks is converted on every call: for tests). `path` ("auto", "rows", "fill": PATHS)
    chooses between the row kernel and qmatmul_fill.c, which give the same bits; "auto" takes the
    faster for M (an int8-activation weight has one path)."""
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
    if path not in PATHS:
        raise ValueError(f"path must be one of {', '.join(PATHS)}, got {path!r}")
    status = _state["lib"].outrider_qmatmul_path(PATHS[path], weight.code, x.data_ptr(), x.shape[0], in_features,
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
    """One line: the kernel's state here, which variant runs and why (`outrider models list` and
    `outrider config` print it; serve's startup line names the variant)."""
    if available():
        name = _state["variant"]
        i8 = ("no int8 activations (they need AVX2)" if not i8_available() else
              "int8 activations (the -i8 dtypes; AVX-VNNI)" if i8_avx_vnni() else "int8 activations (the -i8 dtypes)")
        how = (f"asked for: kernel_variant={asked()}" if asked() != "auto"
               else f"auto: the best this CPU runs of {', '.join(kernel_variants_here())}")
        passed = [_failed[v] for v in kernel_variants_here()[:kernel_variants_here().index(name)] if v in _failed]
        return (f"native kernel {name} ({VARIANT_RUNS[name]}: {rows_per_block()} rows a block; {i8}; "
                f"{_state['path'].name}; {how})" + "".join(f"; {why}" for why in passed))
    return f"native kernel unavailable: {reason()}"


assert BLOCK == 32, "qmatmul.c hard-codes 32-value blocks"
