"""What a bench run runs: the methods file (a preset or --methods) with the command's flags folded
in, for a fresh run; for `--resume`, the run's own settings, read back from its run.json.

    config_for(args, out)     the BenchConfig to run; a ConfigError (one line) when --resume is
                              given flags or a file that differ from the run's, naming them

A run saves its settings (methods file as it ran, flags folded in: methods.with_overrides) in
run.json, so `outrider bench --out DIR --resume` alone continues it as it was started. Flags (or
a file) given with --resume must agree with the run; what differs is named as the user wrote it
("--max-new-tokens 64 differs from the run's 32"). A run saved before settings were kept is
rebuilt from the command, as then, and its identity compared (store.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import ConfigError
from .methods import FLAGS, BenchConfig, load_config, load_preset, parse_config, with_overrides
from .store import IDENTITY, SETTINGS


def flag_overrides(args) -> dict:
    """The settings the command's flags give, by FLAGS' key, each checked."""
    overrides = {}
    if args.model:
        overrides["models"] = tuple(args.model)
    if args.workload:
        overrides["workloads"] = tuple(args.workload)
    for key in ("prompts", "max_new_tokens", "threads"):
        value = getattr(args, key)
        if value is not None:
            if value < 1:
                raise ConfigError(f"--{key.replace('_', '-')} must be a positive integer, got {value}")
            overrides[key] = value
    if getattr(args, "audit_workload", None):
        overrides["audit_workloads"] = tuple(args.audit_workload)
    for key in ("temperature", "top_p", "seed", "audit_samples", "audit_positions", "audit_context", "audit_batch"):
        value = getattr(args, key, None)  # a bench that samples (bench/sampling.py); checked by parse_config
        if value is not None:
            overrides[key] = value
    if args.dtype is not None:
        from ..weights.loader import parse_dtype

        parse_dtype(args.dtype)
        overrides["dtype"] = args.dtype
    if args.kv_dtype is not None:
        from ..weights.loader import parse_kv_dtype

        parse_kv_dtype(args.kv_dtype)
        overrides["kv_dtype"] = args.kv_dtype
    if getattr(args, "expert_budget", None) is not None:  # bench/expert_budget.py
        from .expert_budget import ExpertBudget

        overrides["expert_budget"] = str(ExpertBudget.parse(args.expert_budget))
    return overrides


def config_for(args, out: Path | None) -> BenchConfig:
    """The run's config: the file and flags (a fresh run, or a run saved without settings), else
    for --resume the settings saved in `out`, checked against what the command gives."""
    overrides = flag_overrides(args)
    stored = saved_settings(out) if args.resume and out is not None else None
    if stored is None:
        return with_overrides(_file_config(args), overrides)
    config = parse_config(stored["config"], stored.get("source") or str(out / IDENTITY))
    config = _with_preset(config, stored.get("preset"))
    for key, value in overrides.items():
        _agree(f"{FLAGS[key]} {_shown(value)}", value, config.raw.get(key), "drop it")
    if args.preset or args.methods:
        given = _file_config(args)
        named = f"--preset {args.preset}" if args.preset else f"--methods {args.methods}"
        if _methods(given.raw) != _methods(config.raw):
            raise ConfigError(f"{named} has other methods than the run in --out {out}; drop {named.split()[0]} "
                              f"to resume the run as it was started, or pick another --out")
        for key in FLAGS:
            if key in given.raw and key not in overrides:
                _agree(f"{named} sets {key} = {_shown(given.raw[key])}, which", given.raw[key], config.raw.get(key),
                       f"drop {named.split()[0]}")
    return config


def saved_settings(out: Path) -> dict | None:
    """The settings saved in `out`'s run.json; None when there are none (a run saved before)."""
    try:
        saved = json.loads((Path(out) / IDENTITY).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return saved.get(SETTINGS) if isinstance(saved, dict) else None


def saved_threads(out: Path) -> int | None:
    """The threads the run in `out` ran with (its identity's)."""
    try:
        return json.loads((Path(out) / IDENTITY).read_text(encoding="utf-8")).get("threads")
    except (OSError, ValueError, AttributeError):
        return None


def _file_config(args) -> BenchConfig:
    if args.methods:
        return load_config(args.methods)
    return load_preset(args.preset or "quick")


def _with_preset(config: BenchConfig, preset: str | None) -> BenchConfig:
    from dataclasses import replace

    return replace(config, preset=preset)


def _agree(what: str, value, runs, drop: str) -> None:
    """Refuse `value` (what the command gives) when the run's setting `runs` differs."""
    mine = list(value) if isinstance(value, tuple) else value
    if mine != runs:
        then = "the run, which left it unset" if runs is None else f"the run's {_shown(runs)}"
        raise ConfigError(f"{what} differs from {then}; {drop} to resume the run as it was started, "
                          f"or pick another --out")


def _shown(value) -> str:
    if isinstance(value, (list, tuple)):
        return " ".join(str(v) for v in value)
    return str(value)


def _methods(raw: dict) -> list:
    return json.loads(json.dumps(raw.get("method", []), sort_keys=True, default=str))
