"""One runtime config: the thread policy, the kernel choices and the switches, in one typed object.

    from outrider.config import RuntimeConfig, current, use
    use(RuntimeConfig(threads=2, native_layer=False))   # process-wide, before a model loads
    LLM("smollm2-135m-instruct", config={"linear": "chunked"})   # the same, from the API
    outrider generate --config linear=chunked ...                 # and from the CLI
    outrider config                                               # what is in force, and why

Every field has a documented default and an environment variable (OUTRIDER_<FIELD>, or the one
`outrider config` names; read once when the process first asks); a value given in Python or on the command line wins over the
environment. The config is process-wide because what it steers is: the native library is built
and loaded once per process, and a CPU product's path, once chosen, is never changed in a process
(greedy speculative == greedy autoregressive rests on that, kernels/cpu_linear.py).

`describe()` is the record every bench result and `outrider serve`'s startup line carry: the
config in force, the CPU's instruction sets, and the kernels that ran (`note_kernel`).
"""

from __future__ import annotations

import dataclasses
import os
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

# the CPU as the config reads it (re-exported: config.KERNEL_VARIANTS, config.cpu_info, ...)
from .cpu import ISA_FLAGS, KERNEL_VARIANTS, X86_V3, X86_V4, CpuProfile, cpu_flags, cpu_info, variants_for  # noqa: F401
from .errors import ConfigError

LINEAR_PATHS = ("auto", "linear", "mm_t", "chunked", "packed")
SWITCH = ("auto", "on", "off")
def _default_cache() -> Path:
    return Path.home() / ".cache" / "outrider"


@dataclass(frozen=True)
class RuntimeConfig:
    """How this process runs Outrider. Field docs are what `outrider config` prints."""

    threads: int | None = field(default=None, metadata={
        "doc": "torch and kernel CPU threads; unset: torch's count (OMP_NUM_THREADS or the cores)"})
    follow_free_cores: bool = field(default=True, metadata={
        "doc": "while generating, use only the cores other processes leave free (engine/threads.py); "
               "off when threads is set"})
    cache_dir: Path = field(default_factory=_default_cache, metadata={
        "doc": "pulled and imported models, built kernels, measured profiles"})  # OUTRIDER_CACHE_DIR, OUTRIDER_CACHE
    wheelhouse: Path | None = field(default=None, metadata={
        "doc": "a folder of pre-downloaded wheels, tried before the package registry"})
    bench_fixtures: Path | None = field(default=None, metadata={
        "doc": "a folder of workload source files used instead of fetching them (offline benches)"})
    native: bool = field(default=True, metadata={
        "doc": "build and use Outrider's C kernels (kernels/csrc); off: torch everywhere"})
    native_layer: bool = field(default=True, metadata={
        "doc": "a whole decoder layer in one C call for few-row forwards (kernels/decoder_layer.py)"})
    sliding_ring: bool = field(default=True, metadata={
        "doc": "sliding-window layers keep only the rows their window still reads, in a ring (models/ring_cache.py); "
               "off: every row, masked"})
    linear: str = field(default="auto", metadata={
        "doc": "the CPU float product path: auto (measured per shape) | linear | mm_t | chunked | packed",
        "choices": LINEAR_PATHS})
    amx_prefill: bool = field(default=True, metadata={
        "doc": "a prefill's quantized products on AMX tiles where the CPU has them (exact)"})
    gemm_prefill: str = field(default="auto", metadata={
        "doc": "a prefill's quantized products as dequantize + float GEMM: auto (Intel CPUs) | on | off",
        "choices": SWITCH})
    lossy_bf16_prefill: bool = field(default=False, metadata={
        "doc": "LOSSY: prompt K/V computed in bfloat16 on AMX (decode and verify rows never are)"})
    kernel_variant: str = field(default="auto", metadata={
        "doc": "the C kernels' build: auto (the best this CPU runs) | " + " | ".join(KERNEL_VARIANTS),
        "choices": ("auto", *KERNEL_VARIANTS)})

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            choices = f.metadata.get("choices")
            if choices and value not in choices:
                raise ConfigError(f"config {f.name} must be one of {', '.join(choices)}, got {value!r}")
        if self.kernel_variant != "auto" and self.kernel_variant not in kernel_variants_here():
            raise ConfigError(f"config kernel_variant={self.kernel_variant} does not run on this CPU "
                              f"({_lacking(self.kernel_variant)}); it runs: {', '.join(kernel_variants_here())} (or auto)")
        if self.threads is not None and (isinstance(self.threads, bool) or not isinstance(self.threads, int)
                                         or self.threads < 1):
            raise ConfigError(f"config threads must be a positive integer, got {self.threads!r}")
        for name in ("cache_dir", "wheelhouse", "bench_fixtures"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, Path):
                object.__setattr__(self, name, Path(value).expanduser())

    def replace(self, **changes) -> "RuntimeConfig":
        """A copy with `changes` (field name -> value, parsed from text where it is text)."""
        known = {f.name: f for f in fields(self)}
        parsed = {}
        for name, value in changes.items():
            if name not in known:
                raise ConfigError(f"unknown config key {name!r}: the keys are {', '.join(known)}")
            parsed[name] = _parse(known[name], value) if isinstance(value, str) else value
        return dataclasses.replace(self, **parsed)

    def as_dict(self) -> dict[str, Any]:
        return {f.name: (str(v) if isinstance(v := getattr(self, f.name), Path) else v) for f in fields(self)}


def env_name(name: str) -> str:
    """The environment variable of config key `name`: OUTRIDER_<NAME> unless the field names another."""
    env = {f.name: f.metadata.get("env") for f in fields(RuntimeConfig)}.get(name)
    return env or "OUTRIDER_" + name.upper()


# other names of the same switches, still read (the first found wins)
ENV_ALIASES = {"amx_prefill": ("OUTRIDER_TILE_PREFILL",), "gemm_prefill": ("OUTRIDER_PREFILL_GEMM",),
               "cache_dir": ("OUTRIDER_CACHE",)}


def from_env(environ: dict | None = None) -> RuntimeConfig:
    """The defaults, overridden by OUTRIDER_<FIELD> variables (and OMP_NUM_THREADS for threads)."""
    environ = os.environ if environ is None else environ
    changes = {}
    for f in fields(RuntimeConfig):
        for name in (env_name(f.name), *ENV_ALIASES.get(f.name, ())):
            if environ.get(name, "").strip():
                changes[f.name] = environ[name].strip()
                break
    try:
        return RuntimeConfig().replace(**changes)
    except ConfigError as err:
        raise ConfigError(f"{err} (from the environment)") from None


def _parse(f: dataclasses.Field, text: str):
    """A field's value from text: booleans as 1/0/on/off/true/false/yes/no; paths; ints; choices."""
    text = text.strip()
    kind = str(f.type)
    if kind == "bool":
        low = text.lower()
        if low in ("1", "on", "true", "yes"):
            return True
        if low in ("0", "off", "false", "no"):
            return False
        raise ConfigError(f"config {f.name} is on or off, got {text!r}")
    if "int" in kind:
        if text.lower() in ("", "none", "auto"):
            return None
        try:
            return int(text)
        except ValueError:
            raise ConfigError(f"config {f.name} must be a positive integer, got {text!r}") from None
    if f.metadata.get("choices") and f.name == "gemm_prefill":  # the old 0/1 spelling
        return {"1": "on", "0": "off"}.get(text, text)
    if "Path" in kind:
        return None if text.lower() in ("", "none") else Path(text).expanduser()
    return text


def parse_assignments(items: list[str] | None) -> dict[str, str]:
    """`--config KEY=VALUE` items -> {key: value}; a malformed one is a one-line ConfigError."""
    out = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--config takes KEY=VALUE, got {item!r} (`outrider config` lists the keys)")
        out[key.strip().replace("-", "_")] = value
    return out


_current: list[RuntimeConfig | None] = [None]
_kernels: set[str] = set()
_facts: dict[str, str] = {}


def current() -> RuntimeConfig:
    """The config in force: the last `use()`, else the environment's (read once)."""
    if _current[0] is None:
        _current[0] = from_env()
    return _current[0]


def use(config: RuntimeConfig | dict | None = None, **changes) -> RuntimeConfig:
    """Put `config` (or the current one with `changes`) in force for this process; returns it.
    A dict is read as changes to the current config."""
    if isinstance(config, dict):
        changes = {**config, **changes}
        config = None
    base = config if config is not None else current()
    if not isinstance(base, RuntimeConfig):
        raise TypeError(f"config must be a RuntimeConfig or a dict, got {type(base).__name__}")
    _current[0] = base.replace(**changes) if changes else base
    if _current[0].threads is not None:
        import torch

        torch.set_num_threads(_current[0].threads)
    return _current[0]


@contextmanager
def overriding(**changes):
    """Within: the current config with `changes`; the one before is put back after."""
    before = current()
    try:
        yield use(before.replace(**changes))
    finally:
        _current[0] = before


def cache_dir() -> Path:
    """Where models, kernels and profiles are kept (config cache_dir; $OUTRIDER_CACHE_DIR, or the older $OUTRIDER_CACHE)."""
    return current().cache_dir


def note_kernel(name: str) -> None:
    """Record that kernel `name` ran (or was chosen for a weight) in this process."""
    _kernels.add(name)


def kernels_used() -> list[str]:
    return sorted(_kernels)


def note_fact(key: str, value: str) -> None:
    """Record a fact of this process's runtime (e.g. how the native library was built)."""
    _facts[key] = value


def kernel_variants_here() -> list[str]:
    """The native library's variants this CPU executes, best first (cpu.variants_for on this
    machine's profile): on x86-64 each whose flags it has (none known without /proc/cpuinfo:
    portable only); elsewhere (ARM, ...) portable."""
    return list(variants_for(CpuProfile.here()))


def _lacking(variant: str) -> str:
    here = CpuProfile.here()
    if not here.x86:
        return f"it is built for x86-64, this is {here.machine}"
    missing = [f for f in KERNEL_VARIANTS[variant] if f not in here.flags]
    return f"no {' '.join(missing)}" if here.flags else "no /proc/cpuinfo to read its flags from"


def describe() -> dict[str, Any]:
    """The record of a run: the config in force, the CPU, torch's threads, the kernels that ran."""
    import torch

    return {"config": current().as_dict(), "cpu": cpu_info(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "kernels": kernels_used(), **dict(sorted(_facts.items()))}


def summary_line() -> str:
    """One line for a log: changed config keys, CPU instruction sets, kernels that ran."""
    d = describe()
    default = RuntimeConfig().as_dict()
    changed = [f"{k}={v}" for k, v in d["config"].items() if v != default[k]]
    cpu = d["cpu"]
    variant = f" (C kernels: {d['kernel_variant']})" if d.get("kernel_variant") else ""
    return (f"config: {' '.join(changed) or 'defaults'}; threads {d['torch_threads']}; "
            f"cpu: {cpu['model'] or cpu['machine']} [{' '.join(cpu['isa']) or '-'}]; "
            f"kernels: {', '.join(d['kernels']) or 'torch'}{variant}")
