"""Every decision that depends on the CPU, made in one place from one `CpuProfile`.

    plan = dispatch.plan()                      # the profile in force, the runtime config in force
    plan.variants, plan.variant                 # the C kernels' builds this CPU runs; the one taken
    plan.prefill(rows, lanes=False, drafter=False) -> PrefillPath   # how the decoder fills a prompt
    plan.product(rows, drafter=False) -> Product                    # a filling forward's product
    plan.dtypes                                 # the quantized --dtype names that run here
    with dispatch.pretending(PROFILE): ...      # tests: decide as on another CPU

A `CpuProfile` is what the decisions read of a machine: its architecture, vendor, feature flags,
whether the OS grants this process the AMX tile registers, torch's vectorisation level and its
core count. `CpuProfile.here()` reads this machine's once; a test may put another in force
(`pretending`), so that tests/test_dispatch.py decides for every CPU the developers have (Intel
with AMX, Intel AVX-512, AMD Zen 5, AMD Zen 3, Intel AVX2, ARM) on whichever machine runs it, and
a broken rule for one CPU fails everywhere.

What a pretended profile changes: the policy (prefill paths, products, which dtypes run, thread
defaults). What it cannot change: which library is built and loaded (always this machine's own,
`CpuProfile.here()`), and what the hardware does: a tile call on a CPU without tiles falls back to
the row kernel with the same bits (decoder_layer.c; quant_linear's next path).

The rules, each measured where it was set (docs/kernels.md, Prefill paths; the benchmark pages
cited there):

- variant: the best build whose instruction sets the CPU has (config.KERNEL_VARIANTS), unless
  config kernel_variant names one.
- tiles: a prefill's products of TILE_ROWS rows or more on matmul_amx.c, where the `amx` build
  runs, the OS grants the tiles and config amx_prefill is on (exact: x in three bfloat16 parts).
- gemm_prefill: a prefill's float32 products of BULK_ROWS rows or more as dequantize + float GEMM:
  config on, or auto on Intel (MKL's GEMM beats the row kernel there, not on AMD).
- bfloat16 prefill: a draft model's prompt (its numerics change only its proposals) wherever the
  CPU has the bfloat16 tile unit; the target's only with config lossy_bf16_prefill (LOSSY).
- fill_rows: the row count from which qmatmul's auto path takes qmatmul_fill.c (compile-time per
  build, FILL_ROWS below; tests check the built libraries say the same).
- dtypes: the `-i8` forms need an int8-activation kernel (every build but portable); the
  `-bf16-lossy` forms need torch's vectorised int4 kernel (x86 with AVX2).
- threads: config threads, else one a core; following the free cores unless threads is set.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ..config import RuntimeConfig, current, note_fact
from ..cpu import KERNEL_VARIANTS, CpuProfile, pretending, profile, variants_for  # noqa: F401  (the profile in force)

TILE_ROWS = 24  # rows from which matmul_amx.c beats the row kernel (a prefill's products)
BULK_ROWS = 96  # rows from which a filling forward takes the float GEMM (the row kernel is faster below)
BULK_ROWS_BF16 = 32  # the same for the bfloat16 GEMM
NEVER = 1 << 30
# qmatmul_fill.c's FILL_ROWS and FILL_ROWS_Q8 per build: (4-bit kinds, 8-bit kinds)
FILL_ROWS = {"amx": (32, 64), "avx512-vnni": (32, 64), "avx512": (32, 64), "avx2": (10, 32),
             "portable": (NEVER, NEVER)}
assert tuple(FILL_ROWS) == tuple(KERNEL_VARIANTS)
BASE_DTYPES = ("q8_0", "q4", "q4_0", "gguf")  # weights kept quantized: every CPU (native or blockwise)


class PrefillPath(enum.Enum):
    """How a prefill (a forward that only fills the cache) runs. `fill` is decoder_layer.c's code."""

    TORCH = ("torch layers", None)  # the reference layers; their quantized products per `Product`
    NATIVE = ("native layer", 0)  # outrider_qmatmul: the row kernel, qmatmul_fill.c from fill_rows rows
    TILES = ("native layer, products on AMX tiles", 3)  # exact: x in three bfloat16 parts
    TILES_BF16 = ("native layer, products on AMX tiles in bfloat16", 1)  # a drafter's (or the lossy opt-in)

    @property
    def label(self) -> str:
        return self.value[0]

    @property
    def fill(self) -> int | None:
        return self.value[1]


class Product(enum.Enum):
    """How one quantized product of a filling forward in the torch layers runs (quant_linear)."""

    KERNEL = "qmatmul.c"  # the row kernel (and qmatmul_fill.c), as decode rows
    TILES = "matmul_amx.c"
    GEMM = "dequantize + torch GEMM"
    GEMM_BF16 = "dequantize + torch GEMM in bfloat16"


@dataclass(frozen=True)
class Plan:
    """The decisions for one profile under one runtime config."""

    profile: CpuProfile
    variants: tuple[str, ...]  # builds this CPU runs, best first
    variant: str  # the build taken (before a failed build passes it over: kernels/native.py)
    fill_rows: tuple[int, int]  # qmatmul_fill.c from these rows: (4-bit kinds, 8-bit kinds)
    i8: bool  # the -i8 dtypes' int8-activation kernel
    avx_vnni: bool  # qmatmul_i8_avx2.c's sums on AVX-VNNI's 256-bit vpdpbusd
    tiles: bool  # a prefill's products on the AMX tiles
    gemm_prefill: bool  # a prefill's float32 products as dequantize + float GEMM
    drafter_bf16: bool  # a draft model's prefill in bfloat16
    lossy_bf16: bool  # the target's prefill in bfloat16 (LOSSY opt-in)
    int4_fast: bool  # torch's int4 kernel is vectorised (the -bf16-lossy dtypes)
    dtypes: tuple[str, ...]  # the quantized --dtype names that run here
    threads: int  # the default thread count
    follow_free_cores: bool

    def prefill(self, rows: int, lanes: bool = False, drafter: bool = False) -> PrefillPath:
        """The path of a prefill of `rows` rows: `lanes`, the weights in the int8-activation layout
        (the row kernel is then the fast path at any count); `drafter`, a draft model's prompt."""
        bf16 = self.lossy_bf16 or (drafter and self.drafter_bf16)
        if lanes:
            return PrefillPath.NATIVE
        if self.tiles:
            if rows < TILE_ROWS:
                return PrefillPath.NATIVE
            return PrefillPath.TILES_BF16 if bf16 else PrefillPath.TILES
        if self.gemm_prefill or bf16:  # the torch layers, whose products take the GEMM from BULK_ROWS rows
            return PrefillPath.TORCH
        return PrefillPath.NATIVE

    def product(self, rows: int, drafter: bool = False, tiles: bool = True) -> Product:
        """One quantized product of `rows` rows in a filling forward through the torch layers
        (`tiles` False: the path after the tile kernel declined a weight, out not a multiple of 16)."""
        bf16 = self.lossy_bf16 or (drafter and self.drafter_bf16)
        if tiles and self.tiles and rows >= TILE_ROWS:
            return Product.TILES
        if bf16 and rows >= BULK_ROWS_BF16:
            return Product.GEMM_BF16
        if not bf16 and self.gemm_prefill and rows >= BULK_ROWS:
            return Product.GEMM
        return Product.KERNEL

    def describe(self) -> str:
        """One line: what was decided (`outrider config`)."""
        prefill = self.prefill(BULK_ROWS)
        how = f" ({self.product(BULK_ROWS).value} at {BULK_ROWS} rows)" if prefill is PrefillPath.TORCH else ""
        return (f"{self.profile.name}: build {self.variant} of {', '.join(self.variants)}; "
                f"prefill {prefill.label}{how}; fill kernel from {_rows(self.fill_rows[0])} rows "
                f"({_rows(self.fill_rows[1])} for 8-bit kinds); dtypes {', '.join(self.dtypes)}")


def _rows(n: int) -> str:
    return "never" if n >= NEVER else str(n)


def plan_for(profile: CpuProfile, config: RuntimeConfig) -> Plan:
    """The decisions for `profile` under `config` (pure: no hardware is asked)."""
    variants = variants_for(profile)
    asked = config.kernel_variant
    variant = asked if asked != "auto" and asked in variants else variants[0]
    if not config.native:
        variant = "portable"  # nothing native runs; the torch paths decide
    native = config.native
    i8 = native and variant != "portable"
    int4_fast = profile.x86 and profile.torch_isa in ("AVX2", "AVX512")
    dtypes = BASE_DTYPES + tuple(d + "-i8" for d in BASE_DTYPES if i8) + tuple(
        d + "-bf16-lossy" for d in ("q8_0", "q4") if int4_fast)
    gemm = config.gemm_prefill == "on" or (config.gemm_prefill == "auto" and profile.vendor == "GenuineIntel")
    return Plan(
        profile=profile, variants=variants, variant=variant, fill_rows=FILL_ROWS[variant], i8=i8,
        avx_vnni=i8 and variant in ("avx2", "avx512") and "avx_vnni" in profile.flags,
        tiles=native and variant == "amx" and profile.tiles_granted and config.amx_prefill,
        gemm_prefill=gemm, drafter_bf16=profile.has_amx, lossy_bf16=config.lossy_bf16_prefill and profile.has_amx,
        int4_fast=int4_fast, dtypes=dtypes, threads=config.threads or profile.cores,
        follow_free_cores=config.follow_free_cores and config.threads is None)


def plan() -> Plan:
    """The decisions in force (the profile in force, the runtime config in force)."""
    key = (profile(), current())
    if _PLAN.get("key") != key:
        _PLAN.clear()
        _PLAN.update(key=key, plan=plan_for(*key))
        if key[0] is CpuProfile.here():  # the record of a run (config.describe()): this machine's decisions
            note_fact("dispatch", _PLAN["plan"].describe())
    return _PLAN["plan"]


_PLAN: dict = {}
