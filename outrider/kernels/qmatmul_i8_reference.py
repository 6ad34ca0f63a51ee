"""Int8 activations: the numerics of the `-i8` dtypes, in plain torch (the reference of
native/qmatmul_i8.c, which tests/test_quant_i8.py checks against it).

    codes, scales = quantize_activations(x)      # x float32 [M, K] -> int8 [M, K], float32 [M, K / 32]
    y = reference_linear_i8(x, blocks)           # float64 [M, out]: the exact sums, before float32 rounding

llama.cpp multiplies a GGUF's blocks with activations rounded to 8-bit blocks of 32 values (its
Q8_0 / Q8_1 "vec_dot" types); the `-i8` dtypes do the same. Each 32-value block of a row of x is
kept as a scale d = max|x| / 127 and codes xq = round(x * (1 / d)) (to nearest, ties to even; 0
for an all-zero block), so x ~ d * xq. Worked example: x = [0.5, -1.27, 0.02, 0, ...] (the largest
magnitude 1.27): d = 0.01, xq = [50, -127, 2, 0, ...].

A weight block is d_w * c (+ m_w) with integer codes c, so a block's part of a dot product is
d_w * d_x * sum(c * xq) (- 8 * sum xq for Q4_0; + m_w * d_x * sum(xq) for Q4_1), with the
integer sums exact. The kernel adds those float32 terms in a fixed order (qmatmul_i8.c); this module
gives the same terms summed in float64, so the kernel must come within float32 rounding of a sum
of that many terms (`rounding_bound`). A q8_16 block (Q6_K) has one scale per 16 values: the
same per half.

The scale is float32 (llama.cpp keeps it in float16: a coarser rounding for no gain here), so
the codes are llama.cpp's own but the model is not bit for bit llama.cpp's.
"""

from __future__ import annotations

import torch

from .blocks import BLOCK, GROUP, QuantBlocks


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: float32 [M, K] (K a multiple of 32) -> (codes int8 [M, K], scales float32 [M, K / 32]),
    with qmatmul_i8.c's float32 operations: d = amax / 127, id = 1 / d (0 where d is 0), xq = round(x * id)."""
    M, K = x.shape
    blocks = x.float().reshape(M, K // BLOCK, BLOCK)  # [M, B, 32]
    d = blocks.abs().amax(-1) / 127  # [M, B]
    inverse = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    codes = torch.round(blocks * inverse.unsqueeze(-1))  # half to even, as the CPU's default rounding
    return codes.to(torch.int8).reshape(M, K), d


def block_terms(x: torch.Tensor, blocks: QuantBlocks) -> torch.Tensor:
    """float64 [M, out, groups]: each scale group's term of y = x . W^T under int8 activations
    (the integer sum times its scales), exact but for float64's rounding of the products."""
    codes, dx = quantize_activations(x)  # [M, K], [M, B]
    out_features, in_features = blocks.shape
    group = GROUP[blocks.kind]
    M, groups = x.shape[0], in_features // group
    xq = codes.to(torch.int64).reshape(M, groups, group)  # [M, groups, group]
    c = blocks.codes().to(torch.int64).reshape(out_features, groups, group)  # [out, groups, group]
    isum = torch.einsum("mgi,ngi->mng", xq, c)  # exact integer sums [M, out, groups]
    xsum = xq.sum(-1)  # [M, groups]
    if blocks.kind == "q4_0":
        isum = isum - 8 * xsum.unsqueeze(1)
    per = BLOCK // group  # scale groups a 32-value block (2 for q8_16)
    dxg = dx.double().repeat_interleave(per, dim=1)  # [M, groups]: each group's activation scale
    dw = blocks.d.double().reshape(out_features, groups)  # [out, groups]
    terms = (dw.unsqueeze(0) * dxg.unsqueeze(1)) * isum.double()
    if blocks.kind == "q4_1":
        terms = terms + blocks.m.double().unsqueeze(0) * (dxg * xsum.double()).unsqueeze(1)
    return terms


def reference_linear_i8(x: torch.Tensor, blocks: QuantBlocks) -> torch.Tensor:
    """x: float32 [M, in] -> float64 [M, out]: the int8-activation product's exact block terms, summed."""
    return block_terms(x, blocks).sum(-1)


def rounding_bound(x: torch.Tensor, blocks: QuantBlocks) -> torch.Tensor:
    """float64 [M, out]: how far qmatmul_i8.c's float32 result may be from reference_linear_i8: each
    of a scale group's two or three float32 operations, the adds into its lane and the 16-lane
    reduction round once each: at most `groups + 8` roundings, each of 2**-24 of the sum of
    |terms| at most, allowed twice that (2**-23) for the second-order terms."""
    terms = block_terms(x, blocks)
    return (terms.shape[-1] + 8) * 2.0 ** -23 * terms.abs().sum(-1)
