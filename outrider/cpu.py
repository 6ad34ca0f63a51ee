"""The CPU as Outrider's decisions read it: its feature flags, vendor and model, one `CpuProfile`.

    CpuProfile.here()          # this machine's, read once (/proc/cpuinfo, the OS's AMX grant, torch)
    variants_for(profile)      # the native library's builds it executes, best first
    profile()                  # the profile in force: this machine's, or a test's `pretending`
    with pretending(other): ...

The rules that turn a profile into decisions live in kernels/dispatch.py; this module only reads
the machine (and lets a test pretend another), so that the config (which validates a named build)
and the kernels can both ask it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# the CPU features the kernels look at (x86 /proc/cpuinfo names; ARM's asimd for the record)
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl",
             "avx512_vnni", "avx512_bf16", "avx512vbmi", "amx_tile", "amx_int8", "amx_bf16", "asimd", "sve")
# the native library's builds (kernels/native.py), best first, and the x86 CPU flags each needs
# (x86-64-v3 and -v4 as the compiler's -march takes them); `portable` (plain C) runs on any CPU
X86_V3 = ("sse4_2", "popcnt", "avx", "avx2", "bmi1", "bmi2", "fma", "f16c", "movbe", "abm")
X86_V4 = X86_V3 + ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")
KERNEL_VARIANTS = {"amx": X86_V4 + ("avx512_vnni", "avx512_bf16", "avx512vbmi", "amx_tile", "amx_bf16"),
                   "avx512-vnni": X86_V4 + ("avx512_vnni",), "avx512": X86_V4, "avx2": X86_V3, "portable": ()}


AMX_FLAGS = ("amx_tile", "amx_bf16")


def cpu_info() -> dict[str, Any]:
    """The CPU's vendor, model and the instruction sets the kernels care about (Linux /proc/cpuinfo;
    elsewhere the machine name only)."""
    info = {"machine": platform.machine(), "vendor": "", "model": "", "family": "", "isa": []}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return info
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "vendor_id" and not info["vendor"]:
            info["vendor"] = value
        elif key == "model name" and not info["model"]:
            info["model"] = value
        elif key == "cpu family" and not info["family"]:
            info["family"] = value
        elif key in ("flags", "Features") and not info["isa"]:
            flags = set(value.split())
            info["isa"] = [f for f in ISA_FLAGS if f in flags]
    return info


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo names them (empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features"):
                return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


@dataclass(frozen=True)
class CpuProfile:
    """What the dispatch rules read of a CPU. `flags` as /proc/cpuinfo names them."""

    name: str
    machine: str  # platform.machine(): "x86_64", "aarch64", ...
    vendor: str  # "GenuineIntel", "AuthenticAMD", "" (ARM, or no /proc/cpuinfo)
    flags: frozenset[str]
    tiles_granted: bool  # the OS lets this process use the AMX tile registers
    torch_isa: str  # torch.backends.cpu.get_cpu_capability(): "AVX512", "AVX2", "DEFAULT", ...
    cores: int

    @property
    def x86(self) -> bool:
        return self.machine.lower() in ("x86_64", "amd64")

    @property
    def has_amx(self) -> bool:
        """The bfloat16 tile unit, granted to this process."""
        return self.x86 and all(f in self.flags for f in AMX_FLAGS) and self.tiles_granted

    @classmethod
    def here(cls) -> "CpuProfile":
        """This machine's (read once a process)."""
        if _HERE[0] is None:
            import torch

            flags = cpu_flags()
            granted = all(f in flags for f in AMX_FLAGS) and bool(
                getattr(torch._C._cpu, "_init_amx", lambda: False)())
            info = cpu_info()
            _HERE[0] = cls(name="here", machine=platform.machine(), vendor=info["vendor"], flags=flags,
                           tiles_granted=granted, torch_isa=torch.backends.cpu.get_cpu_capability(),
                           cores=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
        return _HERE[0]


_HERE: list[CpuProfile | None] = [None]
_PRETEND: list[CpuProfile | None] = [None]


def variants_for(profile: CpuProfile) -> tuple[str, ...]:
    """The native library's builds `profile` executes, best first: on x86-64 each whose flags it
    has; portable (plain C) on any CPU."""
    return tuple(name for name, need in KERNEL_VARIANTS.items()
                 if not need or (profile.x86 and all(f in profile.flags for f in need)))


def profile() -> CpuProfile:
    """The profile in force: a test's `pretending`, else this machine's."""
    return _PRETEND[0] or CpuProfile.here()


@contextlib.contextmanager
def pretending(other: CpuProfile):
    """Within: the policy decides as on `other` (the built library stays this machine's)."""
    before = _PRETEND[0]
    _PRETEND[0] = other
    try:
        yield other
    finally:
        _PRETEND[0] = before
