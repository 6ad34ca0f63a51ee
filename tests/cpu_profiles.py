"""The CPUs the developers run on, as kernels/dispatch.py reads them: the dispatch tests decide for
each of them on whatever machine runs the suite (tests/test_dispatch.py), so a rule broken for one
CPU fails everywhere.

Flags as /proc/cpuinfo names them, trimmed to what the rules read (x86-64-v3/v4, the VNNI, bf16,
VBMI and AMX flags) plus a few of each machine's own."""

from __future__ import annotations

import dataclasses

from outrider.config import X86_V3, X86_V4
from outrider.kernels.dispatch import CpuProfile

_BASE = ("fpu", "sse", "sse2", "ssse3", "sse4_1")


def _x86(name: str, vendor: str, flags: tuple[str, ...], torch_isa: str, tiles: bool = False) -> CpuProfile:
    return CpuProfile(name=name, machine="x86_64", vendor=vendor, flags=frozenset(_BASE + flags),
                      tiles_granted=tiles, torch_isa=torch_isa, cores=2)


# Intel Xeon Sapphire Rapids: AVX-512 with VNNI, BF16 and FP16, the AMX tile unit (granted)
INTEL_AMX = _x86("intel-amx", "GenuineIntel", X86_V4 + (
    "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx512vbmi", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8"),
    "AVX512", tiles=True)
# Intel Xeon Ice Lake: AVX-512 with VNNI, no BF16, no AMX
INTEL_AVX512 = _x86("intel-avx512", "GenuineIntel", X86_V4 + ("avx512_vnni", "avx512vbmi", "avx512_vbmi2"), "AVX512")
# AMD EPYC Zen 5: AVX-512 with VNNI and BF16, AVX-VNNI, no AMX
AMD_ZEN5 = _x86("amd-zen5", "AuthenticAMD", X86_V4 + ("avx512_vnni", "avx512_bf16", "avx512vbmi", "avx_vnni"), "AVX512")
# AMD EPYC Zen 3: AVX2 only
AMD_ZEN3 = _x86("amd-zen3", "AuthenticAMD", X86_V3 + ("sha_ni", "vaes"), "AVX2")
# Intel Alder Lake (a desktop or laptop): AVX2 with AVX-VNNI, no AVX-512
INTEL_AVX2 = _x86("intel-avx2", "GenuineIntel", X86_V3 + ("avx_vnni", "sha_ni"), "AVX2")
# An ARM server (Graviton 3): no x86 builds, the portable C kernels
ARM = CpuProfile(name="arm", machine="aarch64", vendor="", flags=frozenset(("fp", "asimd", "sve", "bf16", "i8mm")),
                 tiles_granted=False, torch_isa="DEFAULT", cores=2)
# an Intel CPU with the AMX flags whose OS does not grant the tiles (an old kernel)
INTEL_AMX_UNGRANTED = dataclasses.replace(INTEL_AMX, name="intel-amx-ungranted", tiles_granted=False)

PROFILES = (INTEL_AMX, INTEL_AVX512, AMD_ZEN5, AMD_ZEN3, INTEL_AVX2, ARM)
