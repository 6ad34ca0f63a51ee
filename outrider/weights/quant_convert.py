"""GGUF kinds beyond Q8_0/Q4_0/Q4_1, re-expressed exactly in the block forms our kernels read.

    blocks = gguf_blocks(raw, "Q4_K", "blk.0.ffn_up.weight")   # raw: uint8 [rows, bytes a row]

Each value a K-quant block stands for is a small integer code times a scale (minus a min), where
the scale of a 32- or 16-value group is the super-block's float16 scale times a small integer.
That product is exact in float32 (11 + 6 or 8 bits), so the block can be kept as:

    Q5_0  (32 values: d, 5-bit codes):        w = d * (q - 16)     -> Q8_0, codes q - 16, the same d
    Q4_K  (256 values: d, dmin, 8 x (6-bit scale, 6-bit min), 4-bit codes)
          w = (d * sc_j) * q - (dmin * m_j)                        -> Q4_1 with float32 scale
                                                                      d * sc_j and min -(dmin * m_j)
    Q6_K  (256 values: d, 16 int8 scales, 6-bit codes)
          w = (d * sc_g) * (q - 32)                                -> q8_16: codes q - 32, float32
                                                                      scale d * sc_g per 16 values

and our kernels form w with the same float32 operations as ggml's dequantizer (a product, then
one subtraction), so every weight value equals what `gguf.quants.dequantize` (and llama.cpp)
gives: bit for bit but for the sign of some zeros (0 times a negative code), which no sum can tell
apart. The codes and scales are unpacked from the bytes as ggml lays them out (no float values
are made); tests/test_quant_convert.py checks every kind against `gguf.quants.dequantize` on
random blocks and on the packaged Qwen files. Memory: Q4_K kept so takes 6 bits a value
(4.5 in the file), Q6_K 10 (6.6), Q5_0 8.5 (5.5): a third to a fifth of float32. The native
kernel reads a K-quant's scales factored as the file has them instead (QuantBlocks.factored,
native/block_kinds.h): Q4_K 4.6 bits a value, Q6_K 8.6, the same values.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import ModelError
from ..kernels.blocks import KINDS, QuantBlocks, pack_nibbles, blocks_from_gguf

CONVERTED = ("Q5_0", "Q4_K", "Q6_K")


def gguf_blocks(raw: np.ndarray, type_name: str, tensor: str = "") -> QuantBlocks:
    """raw: uint8 [rows, bytes a row] of a GGUF tensor of `type_name` -> QuantBlocks with the
    same values (see the module docstring). `tensor` names it in errors."""
    if type_name.lower() in KINDS:
        return blocks_from_gguf(raw, type_name.lower())
    if type_name not in _UNPACK:
        raise ModelError(f"GGUF tensor '{tensor}' is {type_name}: quant_convert keeps {', '.join(CONVERTED)}")
    rows = raw.shape[0]
    size = _BYTES[type_name]
    if raw.shape[-1] % size:
        raise ModelError(f"GGUF tensor '{tensor}' ({type_name}): {raw.shape[-1]} bytes a row is not whole blocks")
    blocks = torch.from_numpy(np.array(raw).reshape(rows, -1, size))  # [rows, blocks, bytes] (a writable copy)
    return _UNPACK[type_name](blocks)


_BYTES = {"Q5_0": 22, "Q4_K": 144, "Q6_K": 210}


def _half(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2] little-endian float16 -> float32 [...]"""
    return b.contiguous().view(torch.float16)[..., 0].float()


def _q5_0(b: torch.Tensor) -> QuantBlocks:
    """[rows, blocks, 22]: d (2 bytes), qh (4: bit j is value j's fifth bit), qs (16: value j low
    nibble of byte j, value j + 16 high nibble) -> Q8_0 with codes q - 16 and the same d."""
    rows = b.shape[0]
    d = b[..., 0:2].contiguous().view(torch.float16)[..., 0]  # [rows, blocks]
    qh = b[..., 2:6].contiguous().view(torch.int32)  # [rows, blocks, 1]
    high = (qh >> torch.arange(32, dtype=torch.int32)) & 1  # [rows, blocks, 32]
    qs = b[..., 6:22]
    low = torch.cat((qs & 15, qs >> 4), dim=-1).to(torch.int32)  # [rows, blocks, 32]
    codes = (low | (high << 4)) - 16
    return QuantBlocks("q8_0", codes.to(torch.int8).view(rows, -1), d.contiguous())


def _q4_k(b: torch.Tensor) -> QuantBlocks:
    """[rows, supers, 144]: d, dmin (float16), 12 bytes of 6-bit scales and mins, 128 bytes of
    codes (per 64 values: 32 bytes, the first 32 values in their low nibbles, the next 32 in their
    high nibbles) -> Q4_1 with float32 scale d * sc_j and min -(dmin * m_j) per 32 values."""
    rows = b.shape[0]
    d, dmin = _half(b[..., 0:2]).unsqueeze(-1), _half(b[..., 2:4]).unsqueeze(-1)  # [rows, supers, 1]
    s = b[..., 4:16].to(torch.int32)  # [rows, supers, 12], unpacked as ggml's get_scale_min_k4
    sc = torch.cat((s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)), dim=-1)
    mn = torch.cat((s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)), dim=-1)
    scale = (d * sc.float()).view(rows, -1)  # [rows, cols / 32]; exact: 11 + 6 bits
    low = (dmin * mn.float()).view(rows, -1)
    qs = b[..., 16:144].view(rows, -1, 4, 1, 32)  # [rows, supers, chunk, 1, 32]
    codes = torch.cat((qs & 15, qs >> 4), dim=3)  # [rows, supers, chunk, 2, 32]: sub-blocks 2j, 2j + 1
    packed = pack_nibbles(codes.reshape(rows, -1, 32))
    factored = torch.cat((b[..., 0:4], sc.to(torch.uint8), mn.to(torch.uint8)), dim=-1)  # [rows, supers, 20]
    return QuantBlocks("q4_1", packed, scale.contiguous(), (-low).contiguous(), factored=factored.view(rows, -1))


def _q6_k(b: torch.Tensor) -> QuantBlocks:
    """[rows, supers, 210]: ql (128: low 4 bits), qh (64: high 2 bits), 16 int8 scales, d ->
    q8_16 with codes q - 32 and float32 scale d * sc_g per 16 values. Per 128-value half h and
    l < 32, ggml's layout: value l takes ql[l] low nibble and qh[l] bits 0-1, value l + 32 ql[l + 32]
    low and bits 2-3, value l + 64 ql[l] high and bits 4-5, value l + 96 ql[l + 32] high and bits 6-7."""
    rows = b.shape[0]
    ql = b[..., 0:128].reshape(rows, -1, 2, 2, 32)  # uint8 [rows, supers, half, 2, 32]
    qh = b[..., 128:192].reshape(rows, -1, 2, 32)  # uint8 [rows, supers, half, 32]
    codes = torch.empty(rows, ql.shape[1], 2, 4, 32, dtype=torch.uint8)  # 6-bit codes 0..63, in uint8
    torch.bitwise_or(ql[:, :, :, 0] & 15, (qh & 3) << 4, out=codes[:, :, :, 0])
    torch.bitwise_or(ql[:, :, :, 1] & 15, ((qh >> 2) & 3) << 4, out=codes[:, :, :, 1])
    torch.bitwise_or(ql[:, :, :, 0] >> 4, ((qh >> 4) & 3) << 4, out=codes[:, :, :, 2])
    torch.bitwise_or(ql[:, :, :, 1] >> 4, (qh >> 6) << 4, out=codes[:, :, :, 3])
    codes = codes.view(torch.int8).sub_(32).view(rows, -1)  # q - 32: -32..31 [rows, cols]
    sc = b[..., 192:208].contiguous().view(torch.int8).float()  # [rows, supers, 16]
    d = _half(b[..., 208:210]).unsqueeze(-1)
    factored = torch.cat((b[..., 208:210], b[..., 192:208]), dim=-1)  # [rows, supers, 18]: d, then the codes
    return QuantBlocks("q8_16", codes, (d * sc).view(rows, -1).contiguous(), factored=factored.reshape(rows, -1))


_UNPACK = {"Q5_0": _q5_0, "Q4_K": _q4_k, "Q6_K": _q6_k}
