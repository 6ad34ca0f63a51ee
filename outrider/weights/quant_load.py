"""Where a quantized model's weights come from: the folder's GGUF, kept as it is, or its float
safetensors, quantized at load. `load_decoder(folder, dtype="q4" | "q8_0")` reads through this.

    --dtype q4     the GGUF's own blocks when the folder keeps a GGUF (original.gguf) whose layer
                   projections are 4-bit (Q4_0, Q4_1, Q4_K) and every quantized tensor is of a kind
                   kept (quant.SUPPORTED_GGUF); otherwise the float weights quantized at load:
                   projections to Q4_1, the output head and embedding to Q8_0 (as the packaged
                   SmolLM2 GGUF has them: the head decides the argmax, and is read once per token
                   either way). A GGUF with other kinds (Q5_1, Q2_K, Q3_K, Q5_K) gets one warning
                   line saying so, since the model is then not the GGUF's exact one.
    --dtype q8_0   the GGUF's own blocks when its projections are Q8_0; otherwise every projection,
                   the head and the embedding quantized to Q8_0 at load.
    --dtype q4_0   every projection, the head and the embedding quantized to Q4_0 at load from the
                   float weights, whatever the GGUF keeps: the fewest bytes a step (18 per 32
                   weights), a coarser model than the file's own. For a drafter (`draft-model:
                   NAME@q4_0`) that costs nothing in output: the target verifies every token.
    --dtype gguf   every tensor as the GGUF keeps it, whatever its kinds (Q8_0, Q4_0, Q4_1, and
                   Q5_0, Q4_K, Q6_K re-expressed exactly: weights/quant_convert.py): llama.cpp's K-quant
                   files (Q4_K_M ...) run on their own weights. Refused when the folder has no
                   GGUF or the GGUF holds a kind outside those.
    --dtype q4-bf16-lossy, q8_0-bf16-lossy: the same weights through torch's int4 kernel with bfloat16
                   activations: much faster here, but not yet lossless against autoregressive
                   decoding (quant_linear.py says why); q4 and q8_0 compute in float32 and are.
    --dtype q4-i8, q8_0-i8, q4_0-i8, gguf-i8: the same weights as without "-i8", multiplied as
                   llama.cpp multiplies them: each 32 activations rounded to 8-bit codes and a
                   scale, integer dot products (native/qmatmul_i8.c, AVX-512 VNNI, or qmatmul_i8_avx2.c, AVX2:
                   the same bits; kernels/qmatmul_i8_reference.py). A
                   model of its own (its output differs from q4's as llama.cpp's does), exact
                   under speculation like every dtype here: a k-token verify gives each row what
                   a 1-token step gives, bit for bit. What a verify costs in one-token steps,
                   beside float32 activations: docs/benchmarks/2026-12-01-amd-epyc-zen5-avx512.md,
                   Verify cost.

What stays float: RMSNorm weights, projection biases (Qwen2), rotary tables, the K/V cache and
activations (the compute dtype: float32 on the CPU), and any projection whose input size is not
a multiple of 32 (GGUF's block) or that the GGUF stores as F32 / F16 / BF16. Quantizing at load
works one tensor at a time, so no float copy of the whole model ever exists; a GGUF's blocks are
copied as bytes, with no float values made.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import torch

from ..errors import ModelError
from . import gguf_gemma3
from .gguf_index import GGUFIndex
from .gguf_convert import ARCHITECTURES, CONFIG_TENSORS, hf_tensor_name, unpermute_rotary_rows
from . import gguf_deepseek, gguf_hybrid, gguf_moe
from ..catalog.marker import GGUF_NAME
from ..kernels.blocks import BLOCK, SUPPORTED_GGUF, QuantBlocks, cat_rows, check_gguf_kind, quantize
from .quant_convert import gguf_blocks
from ..kernels.quant_linear import QuantLinear, choose_kernel

QUANT_DTYPES = ("q8_0", "q4", "q4_0", "gguf", "q8_0-i8", "q4-i8", "q4_0-i8", "gguf-i8", "q8_0-bf16-lossy",
                "q4-bf16-lossy")  # --dtype names for quantized weights
_FAMILY = {"q8_0": "Q8", "q4": "Q4"}  # a GGUF is used natively when its projections are of this family
_AT_LOAD = {"q8_0": ("q8_0", "q8_0"), "q4": ("q4_1", "q8_0"), "q4_0": ("q4_0", "q4_0")}  # (projections, head and embedding)
_FLOAT_TYPES = ("F32", "F16", "BF16")
_TABLES = ("model.embed_tokens.weight", "lm_head.weight")
_PROJECTION = re.compile(r"blk\.\d+\.(attn_(q|k|v|output|qkv|gate|q_a|q_b|kv_a_mqa)|ffn_(gate|up|down)(_exps|_shexp)?|ssm_(alpha|beta|ba|out))\.weight")


def warn(line: str) -> None:
    print(line, file=sys.stderr)


_WARNED: set[Path] = set()  # GGUFs already warned about in this process (a drafter and a target may share one)


_OWN: dict[Path, str | None] = {}  # GGUF path -> its own quantization's --dtype name, read once


def own_quantization(folder: str | Path) -> str | None:
    """The --dtype name that runs `folder`'s GGUF on its own blocks ("q4" for Q4_0/Q4_1
    projections, "q8_0" for Q8_0, "gguf" for other or mixed kept kinds such as K-quants), or None:
    no GGUF, one with a kind Outrider does not keep quantized (Q5_1, Q2_K, Q3_K, Q5_K), or float
    projections. Reads the GGUF's tensor table once per process."""
    path = Path(folder) / GGUF_NAME
    if path in _OWN:
        return _OWN[path]
    own = None
    if path.is_file():
        try:
            index = GGUFIndex.open(path)
        except ModelError:
            index = None  # a damaged file is reported when it is loaded, not here
        if index is not None:
            types = {t.type for t in index.tensors.values()}
            projections = {t.type for name, t in index.tensors.items() if _PROJECTION.fullmatch(name)}
            supported = all(t in _FLOAT_TYPES or t in SUPPORTED_GGUF for t in types)
            if supported and projections and projections <= {"Q4_0", "Q4_1", "Q8_0"}:
                own = "q4" if any(t.startswith("Q4") for t in projections) else "q8_0"
            elif supported and projections and not projections <= set(_FLOAT_TYPES):
                own = "gguf"  # mixed kinds (K-quants, Q5_0): every tensor as the file keeps it
    _OWN[path] = own
    return own


class RowStack:
    """Fused projections whose parts are of different kinds (a GGUF may keep V in Q8_0 and Q, K
    in Q4_1): each part multiplies on its own and the outputs are joined, [..., sum of outs]."""

    def __init__(self, parts: list):
        self.parts = parts

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        from ..models.layers import linear

        out = torch.cat([linear(x, p) for p in self.parts], dim=-1)
        return out if bias is None else out + bias


class QuantTensors:
    """The loader's weight source for a quantized model (the same calls as loader._Tensors, plus
    `projection`): float tensors by name, tables (embedding) as QuantBlocks, projections as
    QuantLinear."""

    def __init__(self, folder: Path, dtype_name: str, floats):
        if dtype_name not in QUANT_DTYPES:
            raise ValueError(f"dtype_name must be one of {', '.join(QUANT_DTYPES)}, got {dtype_name!r}")
        self.name, _, compute = dtype_name.partition("-")  # "q4", "bf16-lossy" / "i8"
        self.fast = compute == "bf16-lossy"  # torch's int4 kernel in bfloat16: not lossless, named so
        self.i8 = compute == "i8"  # int8 activations (native/qmatmul_i8.c)
        from ..kernels import dispatch, native

        plan = dispatch.plan()  # which dtypes run on this CPU; the library in use has the last word on -i8
        if self.i8 and (not plan.i8 or not native.i8_available()):
            why = native.reason() or (f"the {native.variant() if plan.i8 else plan.variant} kernel variant has no "
                                      "int8 activations: they need AVX2, the avx2 variant or better")
            raise ModelError(f"--dtype {dtype_name} needs Outrider's int8-activation kernel, which does not run "
                             f"here ({why}); use --dtype {self.name}")
        if self.fast and not plan.int4_fast:
            raise ModelError(f"--dtype {dtype_name} needs torch's vectorised int4 kernel (an x86-64 CPU with "
                             f"AVX2), which this CPU lacks; use --dtype {self.name} (exact)")
        self.floats = floats  # loader._Tensors over the folder's safetensors
        self.gguf = _NativeGGUF.open_if_native(folder / GGUF_NAME, self.name)
        if self.name == "gguf" and self.gguf is None:
            raise ModelError(f"{folder} keeps no GGUF ({GGUF_NAME}): --dtype gguf runs a GGUF's own blocks; "
                             "use --dtype q4 or q8_0 to quantize its float weights at load")
        self.norms_folded = getattr(self.gguf or floats, "norms_folded", False)  # loader.norms_folded
        self.cache: dict[str, QuantBlocks | torch.Tensor] = {}

    @property
    def source(self) -> str:
        return f"GGUF blocks ({self.gguf.path.name})" if self.gguf else "float weights quantized at load"

    def has(self, name: str) -> bool:
        return self.gguf.has(name) if self.gguf else self.floats.has(name)

    def get(self, name: str, dtype: torch.dtype, device: torch.device):
        """A float tensor; the embedding table comes as QuantBlocks (rows dequantized on lookup)."""
        if name == "model.embed_tokens.weight":
            table = self._weight(name)
            if isinstance(table, QuantBlocks):
                return table.to(device, dtype)
            return table.to(device=device, dtype=dtype)
        if self.gguf:
            return self.gguf.floats(name).to(device=device, dtype=dtype)
        # a copy: a view would keep the whole memory-mapped safetensors file (every weight read
        # for quantizing) mapped and resident for the model's life, for a few norm vectors
        return self.floats.get(name, dtype, device).clone()

    def projection(self, names: list[str], dtype: torch.dtype, device: torch.device,
                   rows: torch.Tensor | None = None):
        """The weights `names` stacked along `out` as one QuantLinear (a float tensor when they
        cannot be quantized, a RowStack when their kinds differ); `rows`: only those rows of a
        single weight (a drafter's reduced output head)."""
        parts = [self._weight(n) for n in names]
        if rows is not None:
            parts = [p.rows(rows) if isinstance(p, QuantBlocks) else p.index_select(0, rows) for p in parts]
        columns = self.gguf.columns(names[0]) if self.gguf and len(names) == 1 else None
        if columns is not None and isinstance(parts[0], QuantBlocks):  # a hybrid's ssm_out (gguf_hybrid.py)
            return gguf_hybrid.InputOrder(self._linear(parts[0], dtype, device), columns)
        if all(isinstance(p, QuantBlocks) for p in parts) and len({p.kind for p in parts}) == 1:
            return self._linear(cat_rows(parts), dtype, device)
        if all(isinstance(p, torch.Tensor) for p in parts):
            return torch.cat(parts).to(device=device, dtype=dtype)
        return RowStack([self._linear(p, dtype, device) if isinstance(p, QuantBlocks)
                         else p.to(device=device, dtype=dtype) for p in parts])

    def _linear(self, blocks: QuantBlocks, dtype: torch.dtype, device: torch.device) -> QuantLinear:
        blocks = blocks.to(device)
        if self.i8 and device.type != "cpu":
            raise ModelError(f"the -i8 dtypes run on the CPU only (qmatmul_i8.c), not on {device}; drop the -i8")
        return QuantLinear(blocks, dtype, choose_kernel(blocks, self.fast, dtype, i8=self.i8))

    def _weight(self, name: str) -> QuantBlocks | torch.Tensor:
        """One 2-D weight as blocks (or float when it stays float); tables are kept for reuse
        (a tied head is the embedding)."""
        if name in self.cache:
            return self.cache[name]
        if self.gguf:
            weight = self.gguf.weight(name)
        else:
            projections, tables = _AT_LOAD[self.name]
            floats = self.floats.get(name, torch.float32, torch.device("cpu"))
            kind = tables if name in _TABLES else projections
            weight = quantize(floats, kind) if floats.shape[1] % BLOCK == 0 else floats
        if name in _TABLES:
            self.cache[name] = weight
        return weight


class _NativeGGUF:
    """A GGUF's tensors under Hugging Face names: quantized ones as their own blocks (llama Q/K
    rows, a hybrid's value heads put back in Hugging Face order: gguf_hybrid.py), float ones as
    float32."""

    def __init__(self, index: GGUFIndex):
        self.path = index.path
        self.arch = str(index.meta["general.architecture"])
        name_of = lambda name: hf_tensor_name(name, self.arch)  # noqa: E731
        if self.arch in gguf_hybrid.MODELS:  # MTP blocks as mtp.* (not read); Qwen3-Next's ba rows and experts
            self.tensors = gguf_hybrid.tensors(index, name_of)
        elif gguf_moe.is_moe(index.meta):  # the experts stacked in 3-D, one tensor an expert here
            self.tensors = gguf_moe.tensors(index, name_of)
        elif self.arch == gguf_deepseek.ARCH:  # its experts likewise, and kv_b_proj joined where split
            self.tensors = gguf_deepseek.tensors(index, name_of)
        else:
            self.tensors = {name_of(name): t for name, t in index.tensors.items()
                            if name not in CONFIG_TENSORS}  # rope_freqs: read into config.json (gguf_convert.py)
        arch = str(index.meta["general.architecture"])
        hybrid = arch in gguf_hybrid.MODELS
        self.order = gguf_hybrid.VHeadOrder(index.meta) if arch == gguf_hybrid.ARCH else None
        self.norms_folded = hybrid  # (1 + w) norms stored with the 1 added (loader.norms_folded)
        permuted = ARCHITECTURES.get(arch, (None, None, False))[2]
        heads = int(index.meta[f"{arch}.attention.head_count"])
        kv_heads = int(index.meta.get(f"{arch}.attention.head_count_kv", heads))
        self.rotary_heads = {"self_attn.q_proj": heads, "self_attn.k_proj": kv_heads} if permuted else {}

    @classmethod
    def open_if_native(cls, path: Path, dtype_name: str) -> "_NativeGGUF | None":
        """The GGUF when its layer projections are of the family asked for (4-bit for q4, 8-bit
        for q8_0); None when there is no GGUF or it is of another kind (then floats are quantized)."""
        if not path.is_file() or dtype_name == "q4_0":  # q4_0: always the float weights, quantized at load
            return None
        index = GGUFIndex.open(path)
        types = {t.type for name, t in index.tensors.items() if _PROJECTION.fullmatch(name)}
        if dtype_name != "gguf" and not any(name.startswith(_FAMILY[dtype_name]) for name in types):
            return None
        odd = [(name, t.type) for name, t in index.tensors.items()
               if t.type not in _FLOAT_TYPES and t.type not in SUPPORTED_GGUF]
        if odd and dtype_name == "gguf":
            raise ModelError(f"{path} keeps {odd[0][1]} tensors (e.g. '{odd[0][0]}'), which Outrider cannot keep "
                             f"quantized (supported: {', '.join(SUPPORTED_GGUF)}); use --dtype q4 or q8_0 to "
                             "quantize the float weights at load, or --dtype float32")
        if odd:  # decided before reading anything: the whole model comes from one source
            if path in _WARNED:
                return None
            _WARNED.add(path)
            kinds = ", ".join(sorted({kind for _, kind in odd}))
            warn(f"warning: {path} keeps {kinds} tensors (e.g. '{odd[0][0]}'), which Outrider cannot keep "
                 f"quantized (supported: {', '.join(SUPPORTED_GGUF)}); the float weights are quantized at load "
                 "instead, "
                 f"so this --dtype {dtype_name} model is close to the GGUF's but not its exact one (--dtype "
                 "float32 runs the GGUF's own values, dequantized)")
            return None
        return cls(index)

    def has(self, name: str) -> bool:
        return name in self.tensors

    def _tensor(self, name: str):
        if name not in self.tensors:
            raise ModelError(f"{self.path} is missing tensor '{name}'; the file is incomplete or not this architecture")
        return self.tensors[name]

    def _unpermute(self, name: str, rows: np.ndarray) -> np.ndarray:
        for proj, heads in self.rotary_heads.items():
            if f".{proj}." in name:
                return unpermute_rotary_rows(rows, heads)
        return rows

    def columns(self, name: str) -> np.ndarray | None:
        """long [in]: a hybrid's ssm_out columns in Hugging Face order, as file columns; else None."""
        return self.order.columns(name) if self.order else None

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's Hugging Face shape."""
        shape = self._tensor(name).shape
        return (shape[0], 1, shape[1]) if self.order and name.endswith("conv1d.weight") else shape

    def floats(self, name: str) -> torch.Tensor:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        tensor = self._tensor(name)
        values = np.asarray(dequantize(tensor.data, GGMLQuantizationType[tensor.type]), dtype=np.float32)
        values = self._unpermute(name, values.reshape(tensor.shape))
        if self.order:
            values = gguf_hybrid.undo_float(self.order, name, values)
        if self.arch == gguf_gemma3.ARCH:  # its norms less the folded 1 (gguf_gemma3.py)
            values = gguf_gemma3.undo_float(name, values)
        return torch.from_numpy(np.array(values))  # a writable copy

    def weight(self, name: str) -> QuantBlocks | torch.Tensor:
        tensor = self._tensor(name)
        if tensor.type in _FLOAT_TYPES:
            return self.floats(name)
        kind = check_gguf_kind(tensor.type, tensor.name)
        raw = self._unpermute(name, np.asarray(tensor.data))  # uint8 [out, blocks * bytes]
        rows = self.order.rows(name, raw.shape[0]) if self.order else None
        if rows is not None:
            raw = raw[rows]  # whole rows of blocks; the columns of ssm_out: `columns`
        return gguf_blocks(raw, kind, tensor.name)



class GGUFFloats:
    """A GGUF's tensors as floats under Hugging Face names (llama Q/K rows put back in their
    order), dequantized at load: the float weights of a folder that keeps only its GGUF
    (catalog/imported.py), read as loader._Tensors reads safetensors."""

    def __init__(self, path: Path):
        self.gguf = _NativeGGUF(GGUFIndex.open(path))
        self.norms_folded = self.gguf.norms_folded

    def has(self, name: str) -> bool:
        return self.gguf.has(name)

    def get(self, name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.gguf.floats(name).to(device=device, dtype=dtype)

    def projection(self, names: list[str], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        parts = [self.get(name, dtype, device) for name in names]
        return parts[0] if len(parts) == 1 else torch.cat(parts)


class GGUFShapes(GGUFFloats):
    """A GGUF's tensors as names and Hugging Face shapes only: meta tensors, no data read
    (`outrider models check` on an imported GGUF: loader.load_decoder(shapes_only=True))."""

    def get(self, name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(self.gguf.shape(name), dtype=dtype, device="meta")
