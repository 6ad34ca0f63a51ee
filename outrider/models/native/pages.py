"""The native kernel's weights in 2 MB pages (Linux transparent huge pages).

A decode step streams every weight from memory once. In 4 KB pages that stream crosses a page
boundary every 4 KB: a TLB miss each time, and the hardware prefetcher, which stays within a
page, starts over. Linux serves an anonymous private mapping advised MADV_HUGEPAGE with 2 MB pages
where transparent huge pages are enabled (`madvise`, the common default, or `always`), so at load
each weight tensor of 2 MB or more is copied into such a mapping, 2 MB-aligned; the values are
the same bytes, only the pages change. Measured on the 2-core Xeon (the Qwen 1.5B's 28 gate/up
weights, 15.9 MB each, taken in turn so none is in cache): 10.1-10.7 -> 12.2-12.7 GB/s with two
threads, 5.6-5.8 -> 6.8-7.0 GB/s with one.

Elsewhere (another OS, THP `never`, OUTRIDER_HUGE_PAGES=0) the weights stay where they are.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
from dataclasses import replace

import torch

HUGE = 2 << 20  # bytes in a huge page
TRIM_BYTES = 128 << 20  # old copies handed back to the OS after this many bytes moved
_THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def available() -> bool:
    """Whether weights are placed in huge pages here."""
    if os.environ.get("OUTRIDER_HUGE_PAGES", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    if not hasattr(mmap, "MADV_HUGEPAGE") or not hasattr(mmap, "MAP_PRIVATE"):
        return False
    try:
        with open(_THP) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def huge_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of the contiguous CPU tensor `t` in memory advised for 2 MB pages (the same dtype,
    shape and bytes); `t` itself when it is smaller than a page or not such a tensor. The memory is
    an anonymous mapping kept alive by the returned tensor."""
    nbytes = t.numel() * t.element_size()
    if nbytes < HUGE or t.device.type != "cpu" or not t.is_contiguous():
        return t
    area = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    probe = ctypes.c_char.from_buffer(area)
    start = -ctypes.addressof(probe) % HUGE  # the first 2 MB boundary in the mapping
    del probe  # (an exported buffer would pin the mapping's size)
    area.madvise(mmap.MADV_HUGEPAGE, start, len(area) - start)  # before any page is touched
    out = torch.frombuffer(area, dtype=torch.uint8, count=nbytes, offset=start)  # keeps `area` alive
    out.copy_(t.reshape(-1).view(torch.uint8))
    return out.view(t.dtype).view(t.shape)


def place(decoder) -> int:
    """Move the decoder's native weights (every QuantLinear on the native kernel, stacked parts
    included) into huge pages; an embedding table that shares a tied head's codes follows them.
    Returns the bytes moved (0 where huge pages are not available)."""
    if not available():
        return 0
    from ..quant import QuantBlocks
    from ..quant_linear import QuantLinear

    moved: dict[int, torch.Tensor] = {}  # data_ptr of a tensor -> its copy (shared tensors once)
    untrimmed = [0]  # bytes copied since the old copies' memory was last handed back

    def move(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        if t.data_ptr() not in moved:
            moved[t.data_ptr()] = huge_copy(t)
            untrimmed[0] += t.numel() * t.element_size()
        return moved[t.data_ptr()]

    def linears(obj):
        if isinstance(obj, QuantLinear):
            yield obj
        for part in getattr(obj, "parts", ()):
            yield from linears(part)

    objects = [w for layer in decoder.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    for linear in (lin for obj in objects + [decoder.lm_head] for lin in linears(obj)):
        if linear.kernel == "native":
            w = linear.state["weight"]
            linear.state["weight"] = replace(w, q=move(w.q), d=move(w.d), m=move(w.m))
            del w
            if untrimmed[0] >= TRIM_BYTES:  # the peak stays near one model's worth
                _trim()
                untrimmed[0] = 0
    embed = decoder.embed
    if isinstance(embed, QuantBlocks) and embed.q.data_ptr() in moved:
        decoder.embed = replace(embed, q=moved[embed.q.data_ptr()])
    _trim()
    return sum(t.numel() * t.element_size() for key, t in moved.items() if t.data_ptr() != key)


def _trim() -> None:
    """Hand the memory of the weights' old copies back to the OS: glibc keeps freed blocks of the
    heap for reuse, so without this the process would hold both copies (~0.8 GB more resident on
    the Qwen 1.5B)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
