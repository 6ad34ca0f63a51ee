"""Outrider's own quantized kernel (kernels/native.py): bit-identical rows whatever the batch, the
reference's values (test_quant.py bounds it against the reference with the other kernels), on
every variant of the library this machine executes (kernel_variants.py); the variant chosen at
run time, forced by config, refused where the CPU cannot run it; and a clear fallback where it
cannot be built."""

from __future__ import annotations

import os
from dataclasses import replace
import subprocess
import sys

import pytest
import torch

from outrider import cpu
from outrider.config import cpu_flags
from outrider.kernels import dispatch, native, native_build
from outrider.kernels.blocks import quantize
from outrider.kernels.quant_linear import QuantLinear, choose_kernel, reference_linear
from kernel_variants import ALL, HERE, variant  # noqa: F401  (variant: the fixture)
from cpu_profiles import AMD_ZEN5, ARM, INTEL_AMX, INTEL_AVX512, PROFILES
from test_quant import random_blocks

needs_native = pytest.mark.skipif(not native.available(), reason=f"native kernel: {native.reason()}")


def widened(blocks):
    """The same blocks with float32 scales (and mins), as a K-quant's re-expressed ones are kept."""
    return replace(blocks, d=blocks.d.float(), m=None if blocks.m is None else blocks.m.float())


@needs_native
@pytest.mark.parametrize("variant", ALL, indirect=True)
@pytest.mark.parametrize("kind", ["q8_0", "q4_0", "q4_1", "q4_1 float32 scales", "q8_0 float32 scales"])
def test_rows_are_bit_identical_whatever_the_batch_and_threads(kind, variant):
    """Each output row is the same bits alone, among 2..17 rows (groups of 8 rows share a decoded
    block, the last group smaller), at any offset, and with 1 or 2 threads: what makes a k-token
    verify forward equal k one-token steps. Scales as GGUF keeps them (float16) or widened."""
    blocks = random_blocks(kind.split()[0], 70, 96, seed=3)
    weight = native.NativeWeight.of(widened(blocks) if "float32" in kind else blocks)
    assert weight.d.dtype == (torch.float32 if "float32" in kind else torch.float16)
    x = torch.randn(17, 96, generator=torch.Generator().manual_seed(1))
    assert_rows_bit_identical(weight, x, [(0, 1), (5, 1), (16, 1), (0, 2), (3, 5), (0, 8), (1, 9), (0, 16)])


def assert_rows_bit_identical(weight, x, subsets):
    """native.qmatmul's rows of x (all, with 1 and with 2 threads; then each (start, rows) subset
    alone) are the same bits."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        full = native.qmatmul(x, weight)
        torch.set_num_threads(2)
        assert torch.equal(native.qmatmul(x, weight), full)
        for start, rows in subsets:
            assert torch.equal(native.qmatmul(x[start:start + rows], weight), full[start:start + rows])
    finally:
        torch.set_num_threads(threads)


@needs_native
@pytest.mark.parametrize("variant", ALL, indirect=True)
def test_weights_are_the_references_values(variant):
    """With one-hot rows of x the product reads single weights: exactly dequantize's values (the
    kernel forms each weight with the reference's own multiply and add, no fused rounding)."""
    for kind in ("q8_0", "q4_0", "q4_1"):
        blocks = random_blocks(kind, 24, 64, seed=5)
        eye = torch.eye(64)
        for given in (blocks, widened(blocks)):  # float16 scales read as such, or widened before
            assert torch.equal(native.qmatmul(eye, given).T, reference_linear(eye, blocks).T), kind


@needs_native
@pytest.mark.parametrize("variant", ALL, indirect=True)
def test_real_weights_close_to_reference(variant):
    """Quantized gaussian weights as a model has them; relative error at float32 rounding."""
    w = torch.randn(300, 576, generator=torch.Generator().manual_seed(2)) * 0.05
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(3))
    for kind in ("q8_0", "q4_0", "q4_1"):
        blocks = quantize(w, kind)
        ref = reference_linear(x, blocks)
        got = QuantLinear(blocks, kernel="native").linear(x)
        assert (got - ref).abs().max() <= 1e-5 * ref.abs().max(), kind


@needs_native
def test_the_exact_default_is_native():
    assert choose_kernel(random_blocks("q4_1", 32, 64)) == "native"
    blocks = random_blocks("q4_1", 32, 64)
    weight = QuantLinear(blocks, kernel="native")
    assert weight.nbytes() == 32 * 32 + 2 * 32 * 2 * 2  # codes, float16 scales and mins as GGUF's
    wide = QuantLinear(replace(blocks, d=blocks.d.float(), m=blocks.m.float()), kernel="native")
    assert wide.nbytes() == 32 * 32 + 2 * 32 * 2 * 4  # scales that are not float16 values stay float32
    with pytest.raises(ValueError, match="float32"):
        QuantLinear(random_blocks("q4_1", 32, 64), torch.bfloat16, kernel="native")


@needs_native
@pytest.mark.parametrize("variant", ALL, indirect=True)
def test_library_is_kept_in_the_cache_by_variant_source_and_machine(variant):
    path = native._state["path"]
    assert path.parent.name == "kernels" and path.name.startswith(f"qmatmul-{variant}-") and path.is_file()
    assert native.variant() == variant and native.describe().startswith(f"native kernel {variant} ")
    compiler = native._compiler()
    assert path == native.library_path(compiler, variant)
    assert len({native.library_path(compiler, v) for v in HERE}) == len(HERE)  # a file a variant


@needs_native
def test_auto_takes_the_best_variant_this_cpu_runs(runtime):
    """Config kernel_variant auto: the first of kernel_variants_here that builds; a name: that one;
    one this CPU cannot run: refused in one line that names what it lacks and what runs here."""
    from outrider.config import KERNEL_VARIANTS, ConfigError

    runtime(kernel_variant="auto")
    chosen = native.variant()
    built = [v for v in HERE if v not in native._failed]  # (an old compiler may not build amx)
    assert chosen == built[0] and f"auto: the best this CPU runs of {', '.join(HERE)}" in native.describe()
    runtime(kernel_variant=HERE[-1])
    assert native.variant() == HERE[-1] and f"kernel_variant={HERE[-1]}" in native.describe()
    assert HERE[-1] == "portable"  # plain C runs everywhere
    for name in KERNEL_VARIANTS:
        if name not in HERE:
            with pytest.raises(ConfigError, match=f"config kernel_variant={name} does not run on this CPU .*; "
                                                  f"it runs: {', '.join(HERE)}") as err:
                runtime(kernel_variant=name)
            assert "\n" not in str(err.value)
            with pytest.raises(ConfigError):
                with native.use_variant(name):
                    pass
    runtime(kernel_variant=None)
    assert native.variant() == built[0]


def test_which_variants_a_cpu_runs(monkeypatch):
    """By the CPU's flags, best first: AVX2 without AVX-512 runs avx2 and portable; an ARM CPU (or
    an x86 one whose flags cannot be read) portable only (the rule: dispatch.variants_for; config
    asks it of this machine's profile)."""
    from outrider import config

    v3 = set(config.X86_V3)
    for flags, want in [(v3, ["avx2", "portable"]), (v3 - {"f16c"}, ["portable"]),
                        (set(config.X86_V4), ["avx512", "avx2", "portable"]),
                        (set(config.KERNEL_VARIANTS["amx"]), ["amx", "avx512-vnni", "avx512", "avx2", "portable"]),
                        (set(), ["portable"])]:
        x86 = replace(ARM, machine="x86_64", flags=frozenset(flags))
        assert list(dispatch.variants_for(x86)) == want, flags
        assert list(dispatch.variants_for(replace(x86, machine="aarch64"))) == ["portable"]
    monkeypatch.setattr(cpu, "_HERE", [replace(ARM, flags=frozenset(config.X86_V3))])  # this machine an ARM one
    assert config.kernel_variants_here() == ["portable"]
    with pytest.raises(config.ConfigError, match="kernel_variant=avx2 does not run on this CPU .*built for x86-64, "
                                                 "this is aarch64.*it runs: portable"):
        config.RuntimeConfig(kernel_variant="avx2")
    monkeypatch.setattr(native_build.platform, "machine", lambda: "aarch64")
    assert "-march" not in " ".join(native.variant_flags("portable"))  # the compiler's own target
    assert native.variant_flags("portable")[:4] == ("-O3", "-ffp-contract=off", "-fopenmp", "-fPIC")


@needs_native
def test_a_variant_that_fails_to_build_passes_to_the_next(monkeypatch, runtime):
    """auto: a variant whose build fails is passed over for the next best, its reason kept in
    describe(); asked for by name, its failure is the reason the kernel is unavailable."""
    built = [v for v in HERE if v not in native._failed]
    best = built[0]
    opened = native._open

    def failing(name, compiler):
        if name == best:
            raise RuntimeError("error: unrecognized command-line option (a test's)")
        return opened(name, compiler)

    monkeypatch.setattr(native, "_open", failing)
    monkeypatch.setattr(native, "_failed", {})
    native._state.clear()  # decided again below, and again after the test (with the real _open)
    try:
        runtime(kernel_variant="auto")
        if len(built) > 1:
            assert native.available() and native.variant() == built[1]
            assert f"building qmatmul.c ({best}) failed: error: unrecognized command-line option" in native.describe()
        runtime(kernel_variant=best)
        assert not native.available() and f"({best}) failed" in native.reason()
    finally:
        native._state.clear()


@pytest.mark.parametrize("variant", ALL, indirect=True)
def test_a_float16_cache_row_is_rounded_as_torch_rounds(variant):
    """attention.c's K/V store into a float16 cache (F16C, or the portable conversion): to
    nearest, ties to even, overflow to inf and subnormals as torch's .half()."""
    special = [0.0, -0.0, 1.0, -2.5, 65504.0, 65519.99, 65520.0, -65520.0, 1e9, float("inf"), -float("inf"),
               6.103515625e-05, 6.1e-05, 5.960464477539063e-08, 2.9802322387695312e-08, 2.98023259e-08,
               8.940696716308594e-08, 1e-10, -1e-30, 1.00048828125, 1.00146484375, 2049.0, 2051.0]
    g = torch.Generator().manual_seed(9)
    values = torch.cat([torch.tensor(special), torch.randn(2000, generator=g) * 300,
                        torch.randn(2000, generator=g) * 1e-5, torch.randn(3, generator=g)]).float()  # a tail of 3
    got = torch.full((len(values),), 7.0, dtype=torch.float16)
    native.library().outrider_kv_store(got.data_ptr(), 0, values.data_ptr(), len(values), 1)
    assert torch.equal(got.view(torch.int16), values.half().view(torch.int16))


def _probe(env: dict) -> list[str]:
    code = ("from outrider.kernels import native; from outrider.kernels.quant_linear import choose_kernel; "
            "from test_quant import random_blocks; "
            "print(native.available()); print(native.reason()); print(choose_kernel(random_blocks('q4_1', 32, 64)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env}, cwd=os.path.dirname(__file__))
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_switched_off_falls_back_to_blockwise():
    available, reason, kernel = _probe({"OUTRIDER_NATIVE": "0"})
    assert available == "False" and "native is off" in reason and kernel == "blockwise"


def test_a_failing_build_falls_back_and_says_why(tmp_path):
    """A compiler that fails (here /bin/false) leaves no library behind and the torch kernel in use."""
    available, reason, kernel = _probe({"CC": "false", "OUTRIDER_CACHE": str(tmp_path), "OUTRIDER_NATIVE": "1"})
    assert available == "False" and "failed" in reason and kernel == "blockwise"
    assert not list((tmp_path / "kernels").glob("*.so*"))


@needs_native
@pytest.mark.parametrize("bf16", [False, True])
def test_a_filling_forward_may_take_the_gemm_and_keeps_the_values(bf16, monkeypatch, runtime):
    """Within quant_linear.filling() a linear of BULK_ROWS rows or more (BULK_ROWS_BF16 where the
    GEMM runs in bfloat16, as on CPUs with AMX) multiplies dequantized rows with the GEMM: the same
    products up to summation order (float32) or bfloat16 rounding of x and the weight; outside, or
    below the threshold, the kernel (bit-identical rows) as before."""
    from outrider.kernels import quant_linear

    runtime(lossy_bf16_prefill=bf16, amx_prefill=False, gemm_prefill="on")  # the GEMM path, as on an Intel CPU
    monkeypatch.setattr(cpu, "_PRETEND", [INTEL_AMX])  # the bfloat16 GEMM wherever this runs
    rows = dispatch.BULK_ROWS_BF16 if bf16 else dispatch.BULK_ROWS
    blocks = quantize(torch.randn(200, 576, generator=torch.Generator().manual_seed(4)) * 0.05, "q4_1")
    weight = QuantLinear(blocks, kernel="native")
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(5))
    ref = reference_linear(x, blocks)
    with quant_linear.filling():
        bulk = weight.linear(x)
        small = weight.linear(x[:rows - 1])
    if bf16:  # exactly the bfloat16 product of the rounded operands (float32 sums), near the reference
        rounded = x.to(torch.bfloat16) @ native.dequantize_rows(native.NativeWeight.of(blocks), 0, 200,
                                                                  torch.bfloat16).t()
        assert torch.allclose(bulk, rounded.float(), rtol=1e-2, atol=1e-2 * ref.abs().max())
        assert (bulk - ref).abs().max() <= 2e-2 * ref.abs().max()
    else:
        assert (bulk - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert torch.equal(small, native.qmatmul(x[:rows - 1], blocks))  # fewer rows: still the kernel
    assert torch.equal(weight.linear(x), native.qmatmul(x, blocks))  # not filling: the kernel
    assert not torch.equal(bulk, native.qmatmul(x, blocks))  # the GEMM really ran (another order)


@needs_native
def test_the_float_gemm_takes_a_prefill_only_on_intel_cpus(monkeypatch, runtime):
    """Off Intel CPUs (where MKL measured slower than the row kernel at a prefill's rows) a
    filling forward keeps the row kernel, bit for bit; config gemm_prefill decides when on or off."""
    from outrider.kernels import quant_linear

    for profile, env, want in [(INTEL_AVX512, None, True), (AMD_ZEN5, None, False),
                               (AMD_ZEN5, "1", True), (INTEL_AVX512, "0", False)]:
        runtime(gemm_prefill=env)
        with dispatch.pretending(profile):
            assert dispatch.plan().gemm_prefill is want, (profile.name, env)
    runtime(gemm_prefill="off")
    runtime(amx_prefill=False)
    runtime(lossy_bf16_prefill=False)
    blocks = quantize(torch.randn(64, 576, generator=torch.Generator().manual_seed(4)) * 0.05, "q4_1")
    x = torch.randn(dispatch.BULK_ROWS, 576, generator=torch.Generator().manual_seed(5))
    with quant_linear.filling():
        assert torch.equal(QuantLinear(blocks, kernel="native").linear(x), native.qmatmul(x, blocks))


@needs_native
@pytest.mark.parametrize("profile", [INTEL_AMX, AMD_ZEN5], ids=lambda p: p.name)
def test_a_drafters_prefill_rounds_to_bf16_where_the_cpu_has_amx(profile, monkeypatch, runtime):
    """filling(bf16=True), a draft model's prefill: the bfloat16 GEMM from BULK_ROWS_BF16 rows
    without config lossy_bf16_prefill (a drafter's numerics change only its proposals) where the
    CPU has AMX; elsewhere, and for a target's prefill, the kernel at that many rows."""
    from outrider.kernels import quant_linear

    runtime(lossy_bf16_prefill=False, amx_prefill=False)  # a target's prefill without matmul_amx.c
    blocks = quantize(torch.randn(64, 576, generator=torch.Generator().manual_seed(7)) * 0.05, "q4_1")
    weight = QuantLinear(blocks, kernel="native")
    x = torch.randn(dispatch.BULK_ROWS_BF16, 576, generator=torch.Generator().manual_seed(8))
    monkeypatch.setattr(cpu, "_PRETEND", [profile])
    with quant_linear.filling():
        assert torch.equal(weight.linear(x), native.qmatmul(x, blocks))  # a target's prefill
    with quant_linear.filling(bf16=True):
        drafted = weight.linear(x)
    rounded = (x.to(torch.bfloat16) @ native.dequantize_rows(native.NativeWeight.of(blocks), 0, 64,
                                                              torch.bfloat16).t()).float()
    if profile.has_amx:
        assert torch.allclose(drafted, rounded, rtol=1e-2, atol=1e-2 * rounded.abs().max())
        assert not torch.equal(drafted, native.qmatmul(x, blocks))
    else:
        assert torch.equal(drafted, native.qmatmul(x, blocks))


def test_only_a_draft_models_prefill_may_round(tiny_folders):
    from outrider.drafters.draft_model import DraftModel, build
    from outrider.spec.shapes import parse_shape
    from outrider.weights.loader import load_decoder

    target = load_decoder(tiny_folders["llama"], "cpu", torch.float32)
    drafter = build(DraftModel(str(tiny_folders["llama-draft"])), parse_shape("chain"), target, tiny_folders["llama"])
    assert drafter.decoder.drafter_prefill_bf16 and not target.drafter_prefill_bf16


def test_bf16_prefill_is_off_unless_asked(monkeypatch, runtime):
    """The bfloat16 prefill changes the target's output (lossy): only config lossy_bf16_prefill
    turns it on, and only where the CPU has AMX."""
    for profile in PROFILES:
        with dispatch.pretending(profile):
            runtime(lossy_bf16_prefill=None)
            assert dispatch.plan().lossy_bf16 is False
            runtime(lossy_bf16_prefill="1")
            assert dispatch.plan().lossy_bf16 is (profile is INTEL_AMX), profile.name  # AMX, tiles granted
    runtime(lossy_bf16_prefill="1")
    amx = all(f in cpu_flags() for f in ("amx_bf16", "amx_tile"))
    usable = amx and bool(getattr(torch._C._cpu, "_init_amx", lambda: False)())
    assert dispatch.plan().lossy_bf16 is usable  # this CPU (AMX, tile registers granted) or none


@needs_native
@pytest.mark.parametrize("variant", ALL, indirect=True)
def test_bf16_rows_are_the_float_rows_rounded(variant):
    for kind in ("q8_0", "q4_0", "q4_1"):
        blocks = quantize(torch.randn(40, 128, generator=torch.Generator().manual_seed(6)), kind)
        w = native.NativeWeight.of(blocks)
        assert torch.equal(native.dequantize_rows(w, 3, 37, torch.bfloat16),
                           native.dequantize_rows(w, 3, 37).to(torch.bfloat16))
        wide = native.NativeWeight.of(widened(blocks))
        assert torch.equal(native.dequantize_rows(wide, 3, 37), native.dequantize_rows(w, 3, 37))


def test_only_a_logits_free_batch_fills():
    from outrider.models.batch import pack

    ids = [torch.tensor([1, 2, 3])]
    assert pack([0], [0], ids, logits="none").fills_only
    assert not any(pack([0], [0], ids, logits=mode).fills_only for mode in ("all", "last", "real"))


@needs_native
def test_the_kernel_runs_on_torchs_thread_count_in_any_thread(monkeypatch):
    """OpenMP's thread count is a per-thread setting: a server's worker thread would get every
    core although torch.set_num_threads(1) was called. The kernel gets torch's count each call."""
    import threading

    lib, seen = native.library(), []

    class Recording:
        def __getattr__(self, name):
            return getattr(lib, name)

        def outrider_qmatmul_path(self, *args):
            seen.append(args[-1])
            return lib.outrider_qmatmul_path(*args)

    monkeypatch.setitem(native._state, "lib", Recording())
    weight = native.NativeWeight.of(random_blocks("q4_1", 16, 64))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        worker = threading.Thread(target=native.qmatmul, args=(torch.randn(2, 64), weight))
        worker.start()
        worker.join()
    finally:
        torch.set_num_threads(threads)
    assert seen == [1]
