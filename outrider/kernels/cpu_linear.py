"""The CPU's float matrix product x @ W.T for few rows: which of several paths is fastest on this
machine, measured once (kept on disk for a model's shapes, else once per process) and then fixed.

    y = matmul(x, weight, bias)        # x: [M, in], weight: [out, in] -> [M, out]
    prepare([w1, w2, ...])             # measure the shape classes of a model's weights (once)
    config linear=packed               # force one path (tests, A/B; OUTRIDER_LINEAR); "auto" measures

Why. The BLAS reads a weight at very different speeds for few rows, and which path is fastest
differs between machines and between row counts (docs/benchmarks/2026-11-29-x86-avx2.md,
Autoregressive decoding; docs/benchmarks/2026-11-30-intel-xeon-avx512-amx.md, Verify cost:
"The CPU linear path"). So the path is chosen per weight shape and per bucket of rows (1, 2-4,
5-16, more), by timing each path on the model's own weights (up to 256 MB of each shape, in turn,
so that they come from memory as in a forward: a few weights alone would sit in a large L3 cache,
such as the Xeon's 480 MB, and mislead).

Paths (all float32 in, float32 arithmetic, float32 out for a float32 weight: the same products
summed in another order, so equal within float rounding; tests/test_cpu_linear.py checks each
against `reference` in float64):

- "linear": F.linear (MKL sgemm/sgemv on the weight as stored).
- "mm_t": `weight @ x.T`, one row doubled (a stride-0 row falls back to a slow path).
- "chunked": the weight viewed as chunks of whole rows, at most 64K values each (256 KB of
  float32: they stay in the L2 cache), and one batched matmul over the chunks with x repeated
  (a stride-0 view): each chunk is read from memory once and used for all rows while it is in
  cache, where MKL's GEMM for 4-16 rows read the weights at about half the speed of its 1-row
  GEMV (docs/benchmarks/2026-11-30-intel-xeon-avx512-amx.md, Verify cost: "The CPU linear
  path"). No copy; needs `out` to have a divisor of at least 8 rows that fits.
- "packed": MKL's packed weight (`cblas_sgemm_pack` once per weight, through torch's
  `_mkl_reorder_linear_weight` / `_mkl_linear`); float32 only. Only when forced: it keeps a
  packed copy of every weight (the weight's size again), and on whole models it lost to
  "chunked" at 4-16 rows (docs/experiments.md, Paths kept only as options). The packed form is
  the same for every row count on the MKL measured here (tests check it against the reference at
  several row counts).

Determinism. A choice, once made for a (shape, dtype), is never remeasured in the process, so an
autoregressive run and a speculative run in one process use the same arithmetic for the same
row count (greedy speculative == greedy autoregressive rests on that, tests/test_spec_greedy_equal.py).
A shape first met outside `prepare` (a head, a drafter, a quantized kernel's chunk) is measured
at its first product with that one weight. A model's choice saved on disk (`prepare`'s folder)
makes separate processes on one machine agree too; delete the file to measure again.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from ..config import current, note_kernel

PATHS = ("linear", "mm_t", "chunked", "packed")
SAMPLE_ROWS = (1, 4, 8, 32)  # rows timed for each bucket: 1 | 2-4 | 5-16 | more
_EDGES = (1, 4, 16)  # the largest row count of each bucket but the last
AUTO_PATHS = ("linear", "mm_t", "chunked")  # what "auto" chooses among (packed: forced only, see above)
_SAVE_BYTES = 16 << 20  # prepare keeps the choice of a model at least this large on disk
_MEASURE_BYTES = 256 << 20  # prepare times each shape on up to this much of its weights (more than a cache)

_CHOICE: dict[tuple, tuple[str, ...]] = {}  # (out, in, dtype) -> path per bucket
_PACKED = WeakIdKeyDictionary()  # weight -> its MKL-packed form
_HAS_PACKED = hasattr(torch.ops.mkl, "_mkl_linear") and torch.backends.mkl.is_available()


def bucket(rows: int) -> int:
    """0 for 1 row, 1 for 2-4, 2 for 5-16, 3 for more."""
    for index, edge in enumerate(_EDGES):
        if rows <= edge:
            return index
    return len(_EDGES)


def forced() -> str | None:
    """The path config `linear` forces, or None for "auto"."""
    value = current().linear
    return None if value == "auto" else value


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           transient: bool = False) -> torch.Tensor:
    """x: [M, in], weight: [out, in] on the CPU -> [M, out], by this machine's path for M rows.

    transient: the weight lives for this product only (a dequantized chunk): a forced "packed"
    (which keeps a second form of the weight) takes F.linear instead."""
    path = forced()
    if x.shape[0] == 0:
        path = "linear"
    elif path is None:
        key = (weight.shape[0], weight.shape[1], weight.dtype)
        choice = _CHOICE.get(key)
        if choice is None:
            choice = _keep(key, choose([weight]))
        path = choice[bucket(x.shape[0])]
    if path == "packed" and (transient or not _packed_ok(weight)):
        path = "linear"
    return _RUN[path](x, weight, bias)


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The plain slow product in float64: x: [M, in] -> [M, out] in x's dtype."""
    out = x.double() @ weight.double().T
    if bias is not None:
        out = out + bias.double()
    return out.to(x.dtype)


def prepare(weights: list[torch.Tensor], folder: Path | None = None) -> None:
    """Choose the path of every shape class among `weights` not chosen yet (the first forward of
    a model calls this with all its CPU float weights). SmolLM2-135M: 1-3 s on the 2-core Xeon
    at load 3 (each shape's weights read 3 paths x 4 row counts x 2 rounds, clear losers once).

    folder: where a model of at least 16 MB keeps its choice, keyed like the verify-cost profile
    (processor, torch, threads, the shapes), so that later processes on this machine take the
    same paths without measuring; a file that cannot be read or written is measured again."""
    if forced() is not None:
        return
    by_shape: dict[tuple, list[torch.Tensor]] = {}
    for w in weights:
        if isinstance(w, torch.Tensor) and w.device.type == "cpu" and w.dim() == 2 and w.is_floating_point():
            by_shape.setdefault((w.shape[0], w.shape[1], w.dtype), []).append(w)
    todo = {key: group for key, group in by_shape.items() if key not in _CHOICE}
    if not todo:
        return
    size = sum(w.numel() * w.element_size() for group in todo.values() for w in group)
    path = _cache_path(folder, todo) if folder is not None and size >= _SAVE_BYTES else None
    saved = _read(path) if path is not None else {}
    for key, group in todo.items():
        if saved.get(key):
            _keep(key, tuple(saved[key]))
        else:
            keep = max(4, _MEASURE_BYTES // (group[0].numel() * group[0].element_size()))
            _keep(key, choose(group[:: max(1, len(group) // keep)][:keep]))
    if path is not None and any(not saved.get(key) for key in todo):
        _write(path, {key: _CHOICE[key] for key in todo})


def _keep(key: tuple, choice: tuple[str, ...]) -> tuple[str, ...]:
    """Fix the paths of shape class `key` for this process (the first choice stays) and record them."""
    choice = _CHOICE.setdefault(key, choice)
    for path in set(choice):
        note_kernel(f"torch float {path}")
    return choice


def choices() -> dict[tuple, tuple[str, ...]]:
    """What was chosen so far: (out, in, dtype) -> path for rows 1, 2-4, 5-16, more."""
    return dict(_CHOICE)


def choose(weights: list[torch.Tensor], rounds: int = 2) -> tuple[str, ...]:
    """The fastest path per bucket for weights of one shape, timed on those weights in turn
    (best of `rounds`; paths alternate within a round so load from elsewhere hits them alike;
    a path 1.5x slower than the best in the first round is not timed again)."""
    g = torch.Generator().manual_seed(0)
    inputs = {rows: torch.randn(rows, weights[0].shape[1], generator=g).to(weights[0].dtype) for rows in SAMPLE_ROWS}
    for path in AUTO_PATHS:  # warm-up (thread pools, lazy inits)
        _RUN[path](inputs[1], weights[0], None)
    best = {(path, rows): float("inf") for path in AUTO_PATHS for rows in SAMPLE_ROWS}
    for round_ in range(rounds):
        for rows, x in inputs.items():
            fastest = min(best[path, rows] for path in AUTO_PATHS)
            for path in AUTO_PATHS:
                if round_ and best[path, rows] > 1.5 * fastest:
                    continue  # clearly slower: not timed again
                start = time.perf_counter()
                for w in weights:
                    _RUN[path](x, w, None)
                best[path, rows] = min(best[path, rows], time.perf_counter() - start)
    return tuple(min(AUTO_PATHS, key=lambda path: best[path, rows]) for rows in SAMPLE_ROWS)


# -- the choice on disk -----------------------------------------------------------------------------

def _cache_path(folder: Path, todo: dict) -> Path:
    shapes = sorted(f"{o}x{i}:{str(dtype).removeprefix('torch.')}:{len(group)}" for (o, i, dtype), group in todo.items())
    parts = [platform.processor() or platform.machine(), torch.backends.cpu.get_cpu_capability(), torch.__version__,
             str(torch.get_num_threads()), *shapes]
    return Path(folder) / f"linear-paths-{hashlib.sha256('|'.join(parts).encode()).hexdigest()[:16]}.json"


def _read(path: Path) -> dict:
    try:
        raw = json.loads(path.read_text())
        return {(o, i, getattr(torch, dtype)): tuple(paths) for o, i, dtype, paths in raw["choices"]
                if len(paths) == len(SAMPLE_ROWS) and set(paths) <= set(AUTO_PATHS)}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def _write(path: Path, chosen: dict) -> None:
    rows = [[o, i, str(dtype).removeprefix("torch."), list(paths)] for (o, i, dtype), paths in chosen.items()]
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"choices": rows, "sample_rows": SAMPLE_ROWS}))
        os.replace(tmp, path)
    except OSError:  # a read-only cache: the choice stays in memory for this process
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass


# -- the paths ---------------------------------------------------------------------------------------

def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def _mm_t(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.shape[0]
    if rows == 1:
        x = torch.cat((x, x))  # a real copy: a stride-0 view falls back to the slow path
    out = torch.mm(weight, x.t()).t()[:rows]  # [M, out]
    return out if bias is None else out + bias


_CHUNK_VALUES = 1 << 16  # chunked: values of a weight chunk
_CHUNK_ROWS: dict[tuple[int, int], int] = {}  # (out, in) -> rows of a chunk (a divisor of out), 0: none


def _chunk_rows(out_features: int, in_features: int) -> int:
    key = (out_features, in_features)
    if key not in _CHUNK_ROWS:
        fits = max(1, _CHUNK_VALUES // in_features)
        rows = max(r for r in range(1, min(fits, out_features) + 1) if out_features % r == 0)
        _CHUNK_ROWS[key] = rows if rows >= 8 or rows == out_features else 0
    return _CHUNK_ROWS[key]


def _chunked(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out_features, in_features = weight.shape
    rows = _chunk_rows(out_features, in_features)
    if rows == 0 or not weight.is_contiguous():
        return _linear(x, weight, bias)
    n = out_features // rows
    chunks = weight.view(n, rows, in_features).transpose(1, 2)  # [n, in, rows]
    y = torch.bmm(x.unsqueeze(0).expand(n, -1, -1), chunks)  # [n, M, rows]
    out = y.transpose(0, 1).reshape(x.shape[0], out_features)  # [M, out]
    return out if bias is None else out + bias


def _packed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    packed = _PACKED.get(weight)
    if packed is None:
        packed = _PACKED[weight] = torch.ops.mkl._mkl_reorder_linear_weight(weight, 1)
    # the last argument tells MKL the packed form fits x's row count (it does, see the docstring)
    return torch.ops.mkl._mkl_linear(x.contiguous(), packed, weight, bias, x.shape[0])


def _packed_ok(weight: torch.Tensor) -> bool:
    return _HAS_PACKED and weight.dtype == torch.float32 and weight.device.type == "cpu"


_RUN = {"linear": _linear, "mm_t": _mm_t, "chunked": _chunked, "packed": _packed}
