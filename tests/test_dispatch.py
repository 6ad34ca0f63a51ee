"""Every CPU-dependent decision, for every CPU the developers have, on whichever machine runs this
(kernels/dispatch.py; the profiles: tests/cpu_profiles.py). A row says what each CPU gets; a
broken rule fails here on a machine that lacks the CPU it concerns. Where this machine can check a
decision against what its built libraries do, the last tests do."""

from __future__ import annotations

import itertools

import pytest
import torch

from outrider.config import KERNEL_VARIANTS, RuntimeConfig, kernel_variants_here
from outrider.kernels import dispatch, native
from outrider.kernels.dispatch import FILL_ROWS, NEVER, TILE_ROWS, CpuProfile, PrefillPath, Product, plan_for
from cpu_profiles import AMD_ZEN3, AMD_ZEN5, ARM, INTEL_AMX, INTEL_AMX_UNGRANTED, INTEL_AVX2, INTEL_AVX512, PROFILES
from kernel_variants import ALL, variant  # noqa: F401  (variant: the fixture)

DEFAULT = RuntimeConfig()
I8 = ("q8_0-i8", "q4-i8", "q4_0-i8", "gguf-i8")
LOSSY = ("q8_0-bf16-lossy", "q4-bf16-lossy")
P = PrefillPath

# profile -> (variants, variant, fill_rows, i8, avx_vnni, tiles, gemm_prefill, drafter_bf16, int4_fast)
TABLE = {
    INTEL_AMX: (("amx", "avx512-vnni", "avx512", "avx2", "portable"), "amx", (32, 64), True, False, True, True,
                True, True),
    INTEL_AVX512: (("avx512-vnni", "avx512", "avx2", "portable"), "avx512-vnni", (32, 64), True, False, False, True,
                   False, True),
    AMD_ZEN5: (("avx512-vnni", "avx512", "avx2", "portable"), "avx512-vnni", (32, 64), True, False, False, False,
               False, True),
    AMD_ZEN3: (("avx2", "portable"), "avx2", (10, 32), True, False, False, False, False, True),
    INTEL_AVX2: (("avx2", "portable"), "avx2", (10, 32), True, True, False, True, False, True),
    ARM: (("portable",), "portable", (NEVER, NEVER), False, False, False, False, False, False),
}

# profile -> prefill path of (40 rows, 10 rows, a drafter's 40 rows, 40 rows of int8-layout weights)
PREFILLS = {
    INTEL_AMX: (P.TILES, P.NATIVE, P.TILES_BF16, P.NATIVE),
    INTEL_AVX512: (P.TORCH, P.TORCH, P.TORCH, P.NATIVE),
    AMD_ZEN5: (P.NATIVE, P.NATIVE, P.NATIVE, P.NATIVE),
    AMD_ZEN3: (P.NATIVE, P.NATIVE, P.NATIVE, P.NATIVE),
    INTEL_AVX2: (P.TORCH, P.TORCH, P.TORCH, P.NATIVE),
    ARM: (P.NATIVE, P.NATIVE, P.NATIVE, P.NATIVE),
}

# profile -> a filling forward's product in the torch layers at (10, 40, 100 rows; a drafter's 40)
PRODUCTS = {
    INTEL_AMX: (Product.KERNEL, Product.TILES, Product.TILES, Product.TILES),
    INTEL_AVX512: (Product.KERNEL, Product.KERNEL, Product.GEMM, Product.KERNEL),
    AMD_ZEN5: (Product.KERNEL,) * 4,
    AMD_ZEN3: (Product.KERNEL,) * 4,
    INTEL_AVX2: (Product.KERNEL, Product.KERNEL, Product.GEMM, Product.KERNEL),
    ARM: (Product.KERNEL,) * 4,
}


def test_the_table_covers_every_profile():
    assert set(TABLE) == set(PREFILLS) == set(PRODUCTS) == set(PROFILES)


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.name)
def test_each_cpu_gets_its_builds_and_switches(profile):
    plan = plan_for(profile, DEFAULT)
    variants, chosen, fill_rows, i8, avx_vnni, tiles, gemm, drafter_bf16, int4_fast = TABLE[profile]
    assert plan.variants == variants and plan.variant == chosen
    assert plan.fill_rows == fill_rows
    assert (plan.i8, plan.avx_vnni, plan.tiles, plan.gemm_prefill) == (i8, avx_vnni, tiles, gemm)
    assert (plan.drafter_bf16, plan.lossy_bf16, plan.int4_fast) == (drafter_bf16, False, int4_fast)
    assert set(I8) <= set(plan.dtypes) if i8 else not set(I8) & set(plan.dtypes)
    assert set(LOSSY) <= set(plan.dtypes) if int4_fast else not set(LOSSY) & set(plan.dtypes)
    assert {"q8_0", "q4", "q4_0", "gguf"} <= set(plan.dtypes)
    assert (plan.threads, plan.follow_free_cores) == (profile.cores, True)


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.name)
def test_each_cpu_prefills_its_way(profile):
    plan = plan_for(profile, DEFAULT)
    got = (plan.prefill(40), plan.prefill(10), plan.prefill(40, drafter=True), plan.prefill(40, lanes=True))
    assert got == PREFILLS[profile]
    got = (plan.product(10), plan.product(40), plan.product(100), plan.product(40, drafter=True))
    assert got == PRODUCTS[profile]


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.name)
def test_the_switches_steer_each_cpu(profile):
    """The config's switches: the tiles off, the GEMM on or off, the lossy bfloat16 prefill, a named
    build, nothing native, a thread count."""
    no_tiles = plan_for(profile, DEFAULT.replace(amx_prefill=False))
    assert not no_tiles.tiles
    assert no_tiles.prefill(40) == (P.TORCH if no_tiles.gemm_prefill else P.NATIVE)
    assert plan_for(profile, DEFAULT.replace(gemm_prefill="on")).product(100) in (Product.GEMM, Product.TILES)
    off = plan_for(profile, DEFAULT.replace(gemm_prefill="off"))
    assert not off.gemm_prefill and off.product(100) in (Product.KERNEL, Product.TILES)
    lossy = plan_for(profile, DEFAULT.replace(lossy_bf16_prefill=True))
    assert lossy.lossy_bf16 == profile.has_amx
    assert lossy.prefill(40) == (P.TILES_BF16 if profile.has_amx else PREFILLS[profile][0])
    nothing = plan_for(profile, DEFAULT.replace(native=False))
    assert (nothing.variant, nothing.i8, nothing.tiles) == ("portable", False, False)
    assert plan_for(profile, DEFAULT.replace(threads=1)).threads == 1
    assert not plan_for(profile, DEFAULT.replace(threads=1)).follow_free_cores


def test_a_named_build_is_taken_and_its_rules_follow():
    plan = plan_for(INTEL_AMX, DEFAULT.replace(kernel_variant="avx2")) if "avx2" in kernel_variants_here() else None
    if plan is None:
        pytest.skip("config kernel_variant=avx2 is refused on a CPU without AVX2")
    assert (plan.variant, plan.tiles, plan.fill_rows) == ("avx2", False, FILL_ROWS["avx2"])
    assert plan.prefill(40) == P.TORCH  # Intel: the GEMM


def test_amx_flags_without_the_grant_get_no_tiles():
    plan = plan_for(INTEL_AMX_UNGRANTED, DEFAULT)
    assert plan.variant == "amx" and not plan.tiles and not plan.drafter_bf16
    assert plan.prefill(40) == P.TORCH and plan.product(40) == Product.KERNEL


@pytest.mark.parametrize("profile", (*PROFILES, INTEL_AMX_UNGRANTED), ids=lambda p: p.name)
def test_choosing_is_complete(profile):
    """Every combination of config switches and every row count gets a path: no None, nothing left
    to decide later."""
    switches = itertools.product((True, False), ("auto", "on", "off"), (True, False), (True, False))
    for amx, gemm, lossy, on in switches:
        plan = plan_for(profile, DEFAULT.replace(amx_prefill=amx, gemm_prefill=gemm, lossy_bf16_prefill=lossy,
                                                 native=on))
        assert all(getattr(plan, f) is not None for f in plan.__dataclass_fields__)
        assert plan.variant in plan.variants or plan.variant == "portable"
        for rows in (1, TILE_ROWS - 1, TILE_ROWS, 31, 32, 95, 96, 1000):
            for lanes, drafter in itertools.product((True, False), repeat=2):
                assert isinstance(plan.prefill(rows, lanes=lanes, drafter=drafter), PrefillPath)
            for drafter, tiles in itertools.product((True, False), repeat=2):
                assert isinstance(plan.product(rows, drafter=drafter, tiles=tiles), Product)
        assert plan.describe()


def test_every_build_has_its_fill_rows():
    assert set(FILL_ROWS) == set(KERNEL_VARIANTS)


def test_pretending_changes_the_policy_not_the_library():
    here, library = dispatch.plan(), native.variant()
    with dispatch.pretending(ARM):
        assert dispatch.plan().variant == "portable" and dispatch.profile() is ARM
        assert native.variant() == library  # the library stays this machine's
        assert kernel_variants_here() == list(dispatch.variants_for(CpuProfile.here()))
    assert dispatch.plan() == here and dispatch.profile() is CpuProfile.here()


# -- this machine: the plan against what its built libraries do --------------------------------------

def test_this_machines_profile_gives_the_variants_config_names():
    assert list(dispatch.variants_for(CpuProfile.here())) == kernel_variants_here()
    assert dispatch.plan().variant == kernel_variants_here()[0]


@pytest.mark.parametrize("variant", ALL, indirect=True)
def test_each_built_library_does_what_the_plan_says(variant):
    """fill_rows, the int8 kernel, AVX-VNNI and the tiles, as each build of this machine reports
    them, against the plan for this machine with that build named."""
    plan = dispatch.plan_for(CpuProfile.here(), DEFAULT.replace(kernel_variant=variant))
    assert (native.fill_rows("q4_0"), native.fill_rows("q8_0")) == plan.fill_rows
    assert native.i8_available() == plan.i8
    assert native.i8_avx_vnni() == plan.avx_vnni
    assert native.amx_available() == plan.tiles
    assert torch.backends.cpu.get_cpu_capability() == CpuProfile.here().torch_isa


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.name)
def test_a_dtype_the_cpu_cannot_run_is_refused_in_one_line(profile, tiny_folders):
    """Loading decides by the plan: a dtype outside plan.dtypes is a one-line ModelError naming the
    exact dtype to use instead; one inside loads."""
    from outrider.errors import ModelError
    from outrider.weights.loader import load_decoder

    with dispatch.pretending(profile):
        dtypes = dispatch.plan().dtypes
        for name in ("q4-i8", "q4-bf16-lossy"):
            if name in dtypes:
                assert load_decoder(tiny_folders["llama"], "cpu", name).quantization == name
            else:
                with pytest.raises(ModelError, match=f"--dtype {name} needs .*use --dtype q4") as err:
                    load_decoder(tiny_folders["llama"], "cpu", name)
                assert "\n" not in str(err.value)
