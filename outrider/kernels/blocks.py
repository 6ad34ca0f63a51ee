"""Weights kept quantized in GGUF's blocks: Q8_0, Q4_0 and Q4_1 (and, re-expressed exactly,
the K-quants and Q5_0 of weights/quant_convert.py).

A weight [out, in] is cut along `in` into blocks of 32 values; each block keeps small integer
codes q and a float16 scale d (Q4_1 also a float16 min m). The value a code stands for:

    Q8_0: w = d * q           q in -127..127 (int8)
    Q4_0: w = d * (q - 8)     q in 0..15
    Q4_1: w = d * q + m       q in 0..15
    q8_16 (ours): w = d * q   q int8, one scale per 16 values (how Q6_K's blocks are kept)

Scales and mins may also be float32 (weights/quant_convert.py: a K-quant's super-block scale times its
6-bit sub-block scale, exact in float32 but not in float16).

Worked example, one Q4_1 block: d = 0.5, m = -2.0, codes [0, 3, 15, ...] stand for
[-2.0, -0.5, 5.5, ...]. Q4 codes are stored two to a byte as GGUF stores them: byte j of a block
holds value j in its low nibble and value j + 16 in its high nibble.

`QuantBlocks` holds one weight's blocks as tensors; `dequantize` is the plain reference every
kernel is checked against (the same float32 arithmetic as the `gguf` package's reader);
`quantize` makes blocks from float weights with ggml's reference rounding (so quantizing a
safetensors model gives the blocks llama.cpp's quantizer writes); `blocks_from_gguf` reads the
raw bytes of a GGUF tensor without a float copy. The matrix products are in `quant_linear.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from ..errors import ModelError

BLOCK = 32  # values per block, for every kind here (q8_16: two scale groups a block)
KINDS = ("q8_0", "q4_0", "q4_1")  # the GGUF kinds kept as they are (GGUF type name, lower case)
GROUP = {"q8_0": 32, "q4_0": 32, "q4_1": 32, "q8_16": 16}  # values sharing one scale, per kind
_BLOCK_BYTES = {"q8_0": 2 + BLOCK, "q4_0": 2 + BLOCK // 2, "q4_1": 4 + BLOCK // 2}  # GGUF's layout


@dataclass(frozen=True)
class QuantBlocks:
    """One weight [out, in] as GGUF-style blocks (`in` a multiple of 32).

    q: Q8_0 / q8_16 int8 [out, in]; Q4_* uint8 [out, in / 2] (two codes a byte, GGUF's nibble order).
    d: float16 or float32 [out, in / group], the scales. m: [out, in / 32], Q4_1's mins (else None).
    dtype: the float dtype values come out in (`dequantize`, `lookup`), float32 by default.
    Also serves as an embedding table: `lookup(ids)` dequantizes only the rows asked for.
    """

    kind: str
    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None = None
    dtype: torch.dtype = torch.float32
    # A K-quant's scales as the file keeps them (weights/quant_convert.py; native/block_kinds.h "FACTORED"): uint8
    # [out, in / 256 * 20] (Q4_K: float16 d, dmin, 8 scale and 8 min codes a 256 values) or
    # [out, in / 256 * 18] (Q6_K: float16 d, 16 int8 scale codes), from which d and m above are
    # computed exactly; the native kernel reads these (fewer bytes a step) in their place.
    factored: torch.Tensor | None = None

    def __post_init__(self):
        if self.kind not in GROUP:
            raise ValueError(f"kind must be one of {', '.join(GROUP)}, got {self.kind!r}")
        if (self.m is None) != (self.kind != "q4_1"):
            raise ValueError("pass m (the mins) for q4_1 and only for q4_1")

    @property
    def shape(self) -> tuple[int, int]:
        return self.d.shape[0], self.d.shape[1] * GROUP[self.kind]

    @property
    def device(self) -> torch.device:
        return self.q.device

    def codes(self) -> torch.Tensor:
        """The codes one per value: int8 [out, in] for Q8_0 / q8_16, uint8 0..15 [out, in] for Q4."""
        if self.kind in ("q8_0", "q8_16"):
            return self.q
        out, cols = self.shape
        packed = self.q.view(out, cols // BLOCK, 1, BLOCK // 2)  # [out, blocks, 1, 16]
        codes = torch.empty(out, cols // BLOCK, 2, BLOCK // 2, dtype=torch.uint8, device=self.q.device)
        torch.bitwise_and(packed, 15, out=codes[:, :, :1])  # values 0..15 of each block
        torch.bitwise_right_shift(packed, 4, out=codes[:, :, 1:])  # values 16..31
        return codes.view(out, cols)

    def rows(self, index: torch.Tensor | slice) -> "QuantBlocks":
        """The blocks of the rows `index` (a slice, or a long tensor of row ids)."""
        m = self.m[index] if self.m is not None else None
        factored = self.factored[index] if self.factored is not None else None
        return replace(self, q=self.q[index], d=self.d[index], m=m, factored=factored)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: [...] long -> [..., in] in `dtype`: an embedding lookup that reads only those rows."""
        flat = dequantize(self.rows(ids.reshape(-1)))  # [n, in]
        return flat.view(*ids.shape, self.shape[1])

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> "QuantBlocks":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return replace(self, q=move(self.q), d=move(self.d), m=move(self.m), dtype=dtype or self.dtype,
                       factored=move(self.factored))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.d, self.m) if t is not None)


def cat_rows(parts: list[QuantBlocks]) -> QuantBlocks:
    """Stack weights of one kind along `out` (fusing Q/K/V or gate/up projections); one weight
    comes back as it is (a tied head shares the embedding's blocks, not a copy)."""
    if len(parts) == 1:
        return parts[0]
    kinds = {p.kind for p in parts}
    if len(kinds) != 1:
        raise ValueError(f"cannot stack blocks of different kinds {sorted(kinds)}")
    wide = len({p.d.dtype for p in parts}) > 1  # float16 scales beside float32 ones (weights/quant_convert.py)
    same = (lambda t: t.float()) if wide else (lambda t: t)  # noqa: E731
    m = torch.cat([same(p.m) for p in parts]) if parts[0].m is not None else None
    factored = torch.cat([p.factored for p in parts]) if all(p.factored is not None for p in parts) else None
    return replace(parts[0], q=torch.cat([p.q for p in parts]), d=torch.cat([same(p.d) for p in parts]), m=m,
                   factored=factored)


def dequantize(blocks: QuantBlocks) -> torch.Tensor:
    """The reference: blocks -> [out, in] in `blocks.dtype`, computed in float32 as GGUF does."""
    out, cols = blocks.shape
    group = GROUP[blocks.kind]
    q = blocks.codes().view(out, cols // group, group).float()  # [out, groups, 32 or 16]
    d = blocks.d.float().unsqueeze(-1)  # [out, groups, 1]
    if blocks.kind in ("q8_0", "q8_16"):
        w = d * q
    elif blocks.kind == "q4_0":
        w = d * (q - 8)
    else:
        w = d * q + blocks.m.float().unsqueeze(-1)
    return w.view(out, cols).to(blocks.dtype)


def quantize(weight: torch.Tensor, kind: str) -> QuantBlocks:
    """weight: [out, in] float (in a multiple of 32) -> blocks, rounded as ggml's reference
    quantizer rounds (`quantize_row_*_ref`), so the blocks equal what llama.cpp would write."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if weight.dim() != 2 or weight.shape[1] % BLOCK:
        raise ValueError(f"quantize needs a 2-D weight whose rows are a multiple of {BLOCK} long, "
                         f"got {tuple(weight.shape)}")
    out, cols = weight.shape
    x = weight.float().view(out, cols // BLOCK, BLOCK)  # [out, blocks, 32]
    if kind == "q8_0":
        d = x.abs().amax(-1, keepdim=True) / 127
        scaled = x * _inverse(d)
        q = (scaled.sign() * (scaled.abs() + 0.5).floor()).to(torch.int8)  # roundf: halves away from 0
        return QuantBlocks(kind, q.view(out, cols), d.squeeze(-1).half())
    if kind == "q4_0":
        widest = x.gather(-1, x.abs().argmax(-1, keepdim=True))  # the value of largest magnitude, signed
        d = widest / -8
        codes = (x * _inverse(d) + 8.5).trunc().clamp(0, 15)
        return QuantBlocks(kind, pack_nibbles(codes), d.squeeze(-1).half())
    low, high = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    d = (high - low) / 15
    codes = ((x - low) * _inverse(d) + 0.5).trunc().clamp(0, 15)
    return QuantBlocks(kind, pack_nibbles(codes), d.squeeze(-1).half(), low.squeeze(-1).half())


def _inverse(d: torch.Tensor) -> torch.Tensor:
    """1 / d, and 0 where d is 0 (an all-zero block), as ggml does."""
    return torch.where(d == 0, torch.zeros_like(d), 1 / d)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """codes: [out, blocks, 32] in 0..15 -> uint8 [out, blocks * 16], GGUF's nibble order."""
    out = codes.shape[0]
    c = codes.to(torch.uint8)
    return (c[..., : BLOCK // 2] | (c[..., BLOCK // 2:] << 4)).reshape(out, -1)


def blocks_from_gguf(raw: np.ndarray, kind: str) -> QuantBlocks:
    """raw: uint8 [out, in / 32 * block bytes], a GGUF tensor's data as `gguf.GGUFReader` maps
    it -> QuantBlocks; one copy of the quantized bytes, no float values are made."""
    size = _BLOCK_BYTES[kind]
    out = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(out, -1, size)  # [out, blocks, bytes]
    half = lambda a: torch.from_numpy(np.ascontiguousarray(a).view(np.float16).reshape(out, -1))  # noqa: E731
    d = half(blocks[..., 0:2])
    m = half(blocks[..., 2:4]) if kind == "q4_1" else None
    header = 4 if kind == "q4_1" else 2  # the float16 scale (and min) before the codes
    q = torch.from_numpy(np.ascontiguousarray(blocks[..., header:]).reshape(out, -1))
    if kind == "q8_0":
        q = q.view(torch.int8)
    return QuantBlocks(kind, q, d, m)


SUPPORTED_GGUF = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q6_K")  # kept quantized (weights/quant_convert.py)


def check_gguf_kind(type_name: str, tensor: str) -> str:
    """A GGUF tensor type name ("Q4_1") -> itself when Outrider keeps it quantized; others are refused."""
    if type_name not in SUPPORTED_GGUF:
        raise ModelError(f"GGUF tensor '{tensor}' is {type_name}, which Outrider cannot keep quantized "
                         f"(supported: {', '.join(SUPPORTED_GGUF)}, and F32/F16/BF16 as floats); use "
                         "--dtype float32 to load the dequantized weights")
    return type_name
