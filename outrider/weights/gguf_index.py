"""A GGUF file's tensor index and scalar metadata, read in milliseconds.

    index = GGUFIndex.open(path)
    index.meta["general.architecture"]          # scalar and string fields (arrays are skipped)
    t = index.tensors["blk.0.attn_q.weight"]    # name, type ("Q4_1"), shape (rows, cols), data
    t.data                                      # numpy view into the mapped file: uint8
                                                # [rows, bytes a row] for quantized, float [rows, cols] else

Why not `gguf.GGUFReader`: it builds a numpy object for every element of every array field
(a tokenizer's 49,152 tokens and merges), 2-7 s for the packaged models, for a load that needs
only the tensor table and a few numbers. This reads the header as the GGUF specification lays it
out (ggml/docs/gguf.md: magic, version, counts, key-value pairs, tensor infos, aligned data),
skipping array values by their lengths. The type names and block sizes come from the `gguf`
package (`GGMLQuantizationType`, `GGML_QUANT_SIZES`), so it agrees with the reader on both;
tests/test_gguf_index.py checks it against the reader on the packaged GGUF.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ModelError

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_FLOATS = {"F32": np.float32, "F16": np.float16, "F64": np.float64}


@dataclass(frozen=True)
class IndexedTensor:
    name: str
    type: str  # GGML type name: "F32", "Q4_1", "Q6_K" ...
    shape: tuple[int, ...]  # row-major, outermost first (the reverse of GGUF's ne order)
    data: np.ndarray


class GGUFIndex:
    def __init__(self, path: Path, meta: dict, tensors: dict[str, IndexedTensor]):
        self.path = path
        self.meta = meta
        self.tensors = tensors

    @classmethod
    def open(cls, path: str | Path) -> "GGUFIndex":
        path = Path(path)
        try:
            with open(path, "rb") as f:
                buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            return cls(path, *_parse(buf))
        except (OSError, ValueError, struct.error, KeyError, IndexError) as err:
            raise ModelError(f"{path} is not a readable GGUF file ({err}); download it again (a packaged model: re-pull it)") from None


def _parse(buf) -> tuple[dict, dict[str, IndexedTensor]]:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if buf[:4] != b"GGUF":
        raise ValueError("no GGUF magic")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version < 2:
        raise ValueError(f"GGUF version {version} is not supported (2 or later)")
    pos = 24
    meta = {}

    def string(pos):
        (n,) = struct.unpack_from("<Q", buf, pos)
        return bytes(buf[pos + 8:pos + 8 + n]).decode("utf-8", errors="replace"), pos + 8 + n

    def skip(kind, pos):  # -> position after a value of `kind`
        if kind in _SCALARS:
            return pos + struct.calcsize(_SCALARS[kind])
        if kind == _STRING:
            return pos + 8 + struct.unpack_from("<Q", buf, pos)[0]
        if kind == _ARRAY:
            elem, count = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            if elem in _SCALARS:
                return pos + count * struct.calcsize(_SCALARS[elem])
            for _ in range(count):
                pos = skip(elem, pos)
            return pos
        raise ValueError(f"unknown GGUF value type {kind}")

    for _ in range(n_kv):
        key, pos = string(pos)
        (kind,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        if kind in _SCALARS:
            meta[key] = struct.unpack_from(_SCALARS[kind], buf, pos)[0]
        elif kind == _STRING:
            meta[key] = string(pos)[0]
        pos = skip(kind, pos)
    infos = []
    for _ in range(n_tensors):
        name, pos = string(pos)
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        kind, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        infos.append((name, dims, GGMLQuantizationType(kind).name, offset))
    align = int(meta.get("general.alignment", 32))
    start = -(-pos // align) * align
    tensors = {}
    for name, dims, kind, offset in infos:
        shape = tuple(int(n) for n in reversed(dims))  # [..., rows, cols]
        cols = shape[-1]
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
        row_bytes = cols // block * block_bytes
        raw = np.frombuffer(buf, dtype=np.uint8, count=rows * row_bytes, offset=start + offset)
        if kind in _FLOATS:
            data = raw.view(_FLOATS[kind]).reshape(shape)
        else:
            data = raw.reshape(*shape[:-1], row_bytes) if len(shape) > 1 else raw
        tensors[name] = IndexedTensor(name, kind, shape, data)
    return meta, tensors
