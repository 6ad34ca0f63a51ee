"""Building the native library: its sources, each variant's compiler flags, the cache file a
build goes to, the build itself (a lock, one compiler process a source, an atomic move into
place) and the entry points' ctypes signatures. kernels/native.py loads and dispatches."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
from pathlib import Path

from ..config import KERNEL_VARIANTS, cache_dir

CSRC = Path(__file__).with_name("csrc")
SOURCE = CSRC / "qmatmul.c"
SOURCES = (SOURCE, *(CSRC / f for f in ("decoder_layer.c", "attention.c", "matmul_amx.c", "qmatmul_i8.c",
                                       "qmatmul_i8_avx2.c", "qmatmul_i8_avx_vnni.c", "qmatmul_i8_pack.c",
                                       "qmatmul_fill.c", "gated_delta.c")))  # one library
HEADERS = tuple(CSRC / h for h in ("isa.h", "block_kinds.h", "block_decode.h", "qmatmul_i8.h",
                                   "qmatmul_i8_avx2_dot.h", "attention.h", "attention_lanes.h",
                                   "attention_heads.h"))  # in its key
FLAGS = ("-O3", "-ffp-contract=off", "-fopenmp", "-fPIC")  # every variant's, with its own below
# each variant's instruction sets (the C sources' paths follow them: csrc/isa.h), best first;
# what each needs of the CPU: config.KERNEL_VARIANTS
VARIANT_FLAGS = {
    "amx": ("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16", "-mavx512vbmi", "-mamx-tile", "-mamx-bf16"),
    "avx512-vnni": ("-march=x86-64-v4", "-mavx512vnni"),
    "avx512": ("-march=x86-64-v4",),
    "avx2": ("-march=x86-64-v3",),
    "portable": ("-march=x86-64",),  # the x86-64 baseline (SSE2); elsewhere the compiler's own default
}
assert tuple(VARIANT_FLAGS) == tuple(KERNEL_VARIANTS)
# what each variant runs (describe(), docs/kernels.md)
VARIANT_RUNS = {"amx": "AVX-512, VNNI and AMX tiles", "avx512-vnni": "AVX-512 and VNNI", "avx512": "AVX-512",
                "avx2": "AVX2, FMA, F16C", "portable": "plain C"}


def variant_flags(variant: str) -> tuple[str, ...]:
    """The compiler flags of `variant` on this machine (portable: no -march off x86-64)."""
    own = VARIANT_FLAGS[variant]
    if variant == "portable" and platform.machine().lower() not in ("x86_64", "amd64"):
        own = ()
    return (*FLAGS, *own)


def _link_flags() -> tuple[str, ...]:
    # -Bsymbolic: a library's calls between its own files (decoder_layer.c -> outrider_qmatmul) stay
    # in that library when several variants are loaded in one process
    return ("-shared", "-fopenmp", *(("-Wl,-Bsymbolic",) if platform.system() == "Linux" else ()))


def library_path(compiler: str, variant: str = "avx2") -> Path:
    """Where these sources, built with `variant`'s flags by this compiler for this machine, are kept."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    texts = [s.read_text() for s in (*SOURCES, *HEADERS)]
    flags = " ".join((*variant_flags(variant), *_link_flags()))
    key = hashlib.sha256("\0".join([*texts, flags, version, platform.machine()]).encode())
    return cache_dir() / "kernels" / f"qmatmul-{variant}-{key.hexdigest()[:16]}.so"


def build_library(compiler: str, target: Path, variant: str = "avx2") -> None:
    """Compile each source (at once, one process each) and link them into a temporary file
    beside `target`, then move it into place (atomic). A lock file (one for the folder) lets one
    process build while the others (test workers) wait, then take its library."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent / ".build.lock"):
        if target.is_file():  # another process built it while this one waited
            return
        with tempfile.TemporaryDirectory(prefix=target.stem + ".", dir=target.parent) as tmp:
            objects = [Path(tmp) / (s.stem + ".o") for s in SOURCES]
            jobs = [subprocess.Popen([compiler, *variant_flags(variant), "-c", "-o", str(o), str(s)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                    for s, o in zip(SOURCES, objects)]
            errors = []
            for job in jobs:
                try:
                    _, err = job.communicate(timeout=300)
                except subprocess.TimeoutExpired:
                    job.kill()
                    _, err = job.communicate()
                    err = (err or "") + "\ntimed out"
                if job.returncode != 0:
                    errors.append(err.strip().splitlines()[-1] if err.strip() else "failed")
            if errors:
                raise RuntimeError(errors[0])
            linked = Path(tmp) / "lib.so"
            done = subprocess.run([compiler, *variant_flags(variant), *_link_flags(), "-o", str(linked),
                                   *map(str, objects)], capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "failed")
            os.replace(linked, target)


@contextlib.contextmanager
def _locked(path: Path):
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock (a concurrent build still ends with a whole library)
        yield
        return
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def bind_entry_points(lib) -> None:
    """The entry points' argument and result types."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.outrider_qmatmul.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, ptr, ptr, i64, ptr, ctypes.c_int]
    lib.outrider_qmatmul.restype = ctypes.c_int
    lib.outrider_qmatmul_rows.restype = ctypes.c_int
    lib.outrider_qmatmul_path.argtypes = [ctypes.c_int, *lib.outrider_qmatmul.argtypes]
    lib.outrider_qmatmul_path.restype = ctypes.c_int
    lib.outrider_fill_rows.argtypes = [ctypes.c_int]
    lib.outrider_fill_rows.restype = ctypes.c_int
    lib.outrider_fill_rows_set.argtypes = [ctypes.c_int]
    lib.outrider_fill_rows_set.restype = None
    lib.outrider_dequantize.argtypes = [ctypes.c_int, i64, ptr, ptr, ptr, i64, i64, ptr, ctypes.c_int]
    lib.outrider_dequantize.restype = ctypes.c_int
    lib.outrider_dequantize_bf16.argtypes = [ctypes.c_int, i64, ptr, ptr, ptr, i64, i64, ptr, ctypes.c_int]
    lib.outrider_dequantize_bf16.restype = ctypes.c_int
    f32 = ctypes.c_float
    lib.outrider_layer.argtypes = [i64, i64, i64, i64, i64, i64, ptr, ptr, ptr, ptr, f32, ptr, ptr, ptr, ptr, ptr, ptr,
                                   ptr, ptr, i64, i64, ptr, ptr, ptr, i64, ptr, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                   ptr, ptr]  # the scores option (AttentionMass *, or NULL); paged K/V (KVPages *, or NULL)
    lib.outrider_layer.restype = ctypes.c_int
    lib.outrider_layers.argtypes = [i64, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, ptr, f32, ptr, ptr, i64,
                                    i64, ptr, ptr, ptr, i64, ptr, ctypes.c_int, ctypes.c_int, ctypes.c_int, ptr, ptr]
    lib.outrider_layers.restype = ctypes.c_int
    lib.outrider_kv_store.argtypes = [ptr, i64, ptr, i64, ctypes.c_int]
    lib.outrider_kv_store.restype = None
    lib.outrider_amx_matmul.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, ptr, ptr, i64, ptr, ctypes.c_int, ctypes.c_int]
    lib.outrider_amx_matmul.restype = ctypes.c_int
    lib.outrider_amx_ok.restype = ctypes.c_int
    lib.outrider_i8_ok.restype = ctypes.c_int
    lib.outrider_i8_avx_vnni.argtypes = [ctypes.c_int]
    lib.outrider_i8_avx_vnni.restype = ctypes.c_int
    lib.outrider_i8_peak.argtypes = [i64, ctypes.c_int]
    lib.outrider_i8_peak.restype = ctypes.c_int
    lib.outrider_i8_row_bytes.argtypes = [ctypes.c_int, i64]
    lib.outrider_i8_row_bytes.restype = i64
    lib.outrider_i8_pack.argtypes = [ctypes.c_int, i64, ptr, ptr, ptr, i64, i64, ptr, ctypes.c_int]
    lib.outrider_i8_pack.restype = ctypes.c_int
    lib.outrider_delta_tree.argtypes = [i64, i64, i64, i64, i64, *[ptr] * 14, ctypes.c_int]
    lib.outrider_delta_tree.restype = ctypes.c_int
    lib.outrider_delta_fold.argtypes = [i64, i64, i64, i64, ptr, ptr, ptr, ptr, ctypes.c_int]
    lib.outrider_delta_fold.restype = None
