"""Expert stores whose misses cost what a slow tier costs (issue 41, DraftExpert's offload runs):
models/expert_store.py reads experts through safe_open's mmap, so on a machine whose page cache
holds the file a miss is a memory copy. These subclasses change only how one tensor is read:

    DirectStore(paths, layers, experts, budget)            # each read with O_DIRECT: from the disk
    PacedStore(paths, layers, experts, budget, gb_per_s)   # each read, then held until bytes / rate

DirectStore: the tensor's bytes (safetensors: an 8-byte header length, a JSON header of
data_offsets, then the data) read by os.preadv from a file descriptor opened with O_DIRECT, into a
page-aligned buffer over the 4 KiB blocks that hold them: the page cache is bypassed, so every
miss is a disk read (Linux; a file system refusing O_DIRECT is refused in one line). Slices of
fused [N, ...] tensors read only the expert's rows.

PacedStore: the read as ExpertStore does it, then a sleep until bytes / gb_per_s seconds have
passed since it began: an emulated tier of that bandwidth (host-to-accelerator links, flash).
The sleep releases the interpreter, so a prefetch thread's reads overlap compute as a DMA would.
Its figures are an emulation: label them so.

Both count bytes_read and read_s as ExpertStore does (the read's own time).
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import time

import torch

from ..errors import ModelError
from .expert_store import ExpertStore

_BLOCK = 4096
_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class DirectStore(ExpertStore):
    def __init__(self, paths, layers: int, experts: int, budget: int, dtype: torch.dtype | None = None,
                 prefix: str = "model.layers.{layer}.mlp.experts"):
        super().__init__(paths, layers, experts, budget, dtype, prefix)
        if not hasattr(os, "O_DIRECT"):
            raise ModelError("O_DIRECT reads need Linux; use PacedStore to emulate a slow tier")
        self._fds, self._offsets = {}, {}
        for path in ([paths] if isinstance(paths, (str, os.PathLike)) else paths):
            path = str(path)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            except OSError as err:
                raise ModelError(f"cannot open {path} with O_DIRECT ({err.strerror}): use PacedStore") from None
            with open(path, "rb") as f:
                n = struct.unpack("<Q", f.read(8))[0]
                header = json.loads(f.read(n))
            for name, info in header.items():
                if name != "__metadata__":
                    self._offsets[name] = (fd, 8 + n + info["data_offsets"][0], info["dtype"], info["shape"])
            self._fds[path] = fd

    def _read_one(self, name: str, index: int | None) -> torch.Tensor:
        fd, start, dtype, shape = self._offsets[name]
        if dtype not in _DTYPES:
            raise ModelError(f"{name}: dtype {dtype} is not read by DirectStore")
        dt = _DTYPES[dtype]
        size = torch.tensor([], dtype=dt).element_size()
        count = 1
        for s in (shape[1:] if index is not None else shape):
            count *= s
        if index is not None:
            start += index * count * size
        first = start // _BLOCK * _BLOCK
        length = -(-(start + count * size - first) // _BLOCK) * _BLOCK
        buf = mmap.mmap(-1, length)  # page-aligned, as O_DIRECT wants
        if os.preadv(fd, [buf], first) < start - first + count * size:
            raise ModelError(f"{name}: short read")
        t = torch.frombuffer(buf, dtype=dt, count=count, offset=start - first).clone()
        t = t.reshape(shape[1:] if index is not None else shape)
        with self._count:
            self.stats.bytes_read += t.numel() * t.element_size()
        return t if self.dtype is None else t.to(self.dtype)

    def close(self) -> None:
        super().close()
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}


class PacedStore(ExpertStore):
    def __init__(self, paths, layers: int, experts: int, budget: int, gb_per_s: float,
                 dtype: torch.dtype | None = None, prefix: str = "model.layers.{layer}.mlp.experts"):
        if gb_per_s <= 0:
            raise ModelError(f"an emulated tier needs a bandwidth above 0 GB/s, got {gb_per_s}")
        self.gb_per_s = gb_per_s
        super().__init__(paths, layers, experts, budget, dtype, prefix)

    def _read_one(self, name: str, index: int | None) -> torch.Tensor:
        t0 = time.perf_counter()
        t = super()._read_one(name, index)
        left = t.numel() * t.element_size() / (self.gb_per_s * 1e9) - (time.perf_counter() - t0)
        if left > 0:
            time.sleep(left)
        return t
