"""What `outrider check-head` does for every kind of head: one `Check` a line, the weights file's
header read once, its float tensors' dtypes (one dtype, the config's torch_dtype), the golden
re-measured: what the head computes (golden logits, heads/golden_compute.py), then its tau
(heads/eagle3/check.py, heads/dflash/check.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import OutriderError
from .golden import GOLDEN, compare, read_golden, settings_of
from .golden_compute import compare_computes

WEIGHTS = "model.safetensors"
FLOATS = (torch.float32, torch.bfloat16, torch.float16)
SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I64": torch.int64,
                      "BOOL": torch.bool, "I32": torch.int32, "F64": torch.float64}


@dataclass
class Check:
    name: str
    status: str  # "ok" | "FAIL" | "skipped"
    detail: str = ""

    def line(self) -> str:
        if self.status == "ok":
            return f"{self.name:<18} ok" + (f" ({self.detail})" if self.detail else "")
        return f"{self.name:<18} {self.status}: {self.detail}"


def weights_check(folder: Path, add, what: str = "an EAGLE-3 head") -> dict | None:
    """model.safetensors' header (name -> (shape, dtype)), or None after a FAIL saying the file is
    missing, truncated or corrupt: that is the problem, not any tensor a later check would miss."""
    from safetensors import safe_open

    path = folder / WEIGHTS
    if not path.is_file():
        add("weights file", "FAIL", f"{path} not found: {what} keeps its tensors there; copy the whole "
                                    "folder again or re-export the head")
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            header = {n: (tuple(f.get_slice(n).get_shape()), SAFETENSORS_DTYPES.get(f.get_slice(n).get_dtype()))
                      for n in f.keys()}
    except Exception as err:  # safetensors' own error for a cut or damaged file  # noqa: BLE001
        reason = " ".join(str(err).split()) or type(err).__name__
        add("weights file", "FAIL", f"{path} is truncated or corrupt ({path.stat().st_size} bytes; {reason}): "
                                    "copy it again or re-export the head")
        return None
    add("weights file", "ok", f"{len(header)} tensors, {path.stat().st_size} bytes")
    return header


TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_problems(header: dict, raw: dict) -> list[str]:
    """The float tensors' dtypes, one phrase each: all one dtype (an engine loads a head in one;
    a tensor in another was rewritten by hand), and the config's torch_dtype (top level, or a
    speculators config's transformer_layer_config) when it names one. d2t / t2d are not floats."""
    floats = {n: d for n, (_, d) in header.items() if d in FLOATS}
    if not floats:
        return []
    counts: dict = {}
    for dtype in floats.values():
        counts[dtype] = counts.get(dtype, 0) + 1
    main = max(counts, key=counts.get)
    problems = []
    odd = sorted(n for n, d in floats.items() if d != main)
    if odd:
        shown = ", ".join(f"{n} {_name(floats[n])}" for n in odd[:3])
        shown += f" and {len(odd) - 3} more" if len(odd) > 3 else ""
        problems.append(f"mixed float dtypes: {shown} among {counts[main]} {_name(main)} tensors (engines load a "
                        "head in one dtype)")
    layer = raw.get("transformer_layer_config") if isinstance(raw.get("transformer_layer_config"), dict) else {}
    said = raw.get("torch_dtype", layer.get("torch_dtype"))
    if said is not None and TORCH_DTYPES.get(said) not in (None, main):
        problems.append(f"config.json's torch_dtype is {said} but the tensors are {_name(main)}")
    return problems


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def config_check(folder: Path, raw: dict, fields, read_config, summary, add):
    """The head's config read by its kind's `read_config` once its fields have the types the
    kind's table `fields` says (files.field_problems); "config fields" ok with `summary(config)`,
    or a FAIL saying what to fix; the config or None."""
    from .files import field_problems

    problems = field_problems(raw, fields)
    if problems:
        add("config fields", "FAIL", f"{'; '.join(problems)}: fix config.json or re-export the head")
        return None
    try:
        config = read_config(folder)
    except OutriderError as err:
        add("config fields", "FAIL", str(err))
        return None
    add("config fields", "ok", summary(config))
    return config


def target_of(target, add) -> tuple:
    """(the target's folder, its ModelConfig), or (None, None) after a FAIL saying why it cannot be read."""
    from ..catalog.resolve import resolve_model
    from ..models.config import ModelConfig

    try:
        target_path = resolve_model(target)
        return target_path, ModelConfig.load(target_path)
    except OutriderError as err:
        add("target", "FAIL", str(err))
        return None, None


def fit_check(config, tcfg, target, misfit, add) -> None:
    """"target" ok with the target's sizes, or a FAIL with the kind's `misfit(config, tcfg)` reason."""
    reason = misfit(config, tcfg)
    add("target", "FAIL" if reason else "ok", reason or f"{target}: hidden {tcfg.hidden_size}, "
                                                        f"vocab {tcfg.vocab_size}, {tcfg.num_layers} layers")


def shape_problems(header: dict, required: dict, optional: dict, what: str, ignore: tuple = ()) -> list[str]:
    """What is wrong with a head's tensor names and shapes against those its config implies:
    `required` and `optional` name -> shape; `what` ends the unexpected-tensor message; `ignore`
    names a layout may carry without the config implying them."""
    problems = []
    missing = [n for n in required if n not in header]
    extra = [n for n in header if n not in required and n not in optional and n not in ignore]
    if missing:
        problems.append(f"missing {', '.join(missing)}")
    if extra:
        problems.append(f"unexpected {', '.join(extra)} ({what})")
    for name, shape in {**required, **optional}.items():
        if name in header and header[name][0] != shape:
            problems.append(f"{name} has shape {list(header[name][0])}, the config implies {list(shape)}")
    return problems


def golden_last(checks: list, add, golden: bool, folder: Path, target_path, device, measure,
                export_command: str) -> None:
    """The golden re-measured, last: skipped when not asked for or while any check failed (their
    names said), else golden_check."""
    failed = [c.name for c in checks if c.status == "FAIL"]
    if not golden:
        add("golden tau", "skipped", "not asked for (--no-golden)")
    elif failed:
        add("golden tau", "skipped", f"not measured: fix the failed check(s) first ({', '.join(failed)})")
    else:
        golden_check(folder, target_path, device, add, measure, export_command)


def golden_check(folder: Path, target_path, device, add, measure, export_command: str) -> None:
    """Re-measure the folder's outrider_golden.json with `measure` (its kind's) and compare."""
    try:
        golden = read_golden(folder)
    except (ValueError, OSError) as err:
        add("golden tau", "FAIL", f"{GOLDEN} is unreadable ({err}); re-export the head to record it again")
        return
    if golden is None:
        add("golden tau", "skipped", f"no {GOLDEN} (not exported by Outrider); `{export_command}` records one")
        return
    try:
        measured = measure(folder, target_path, settings_of(golden, device), golden["prompts"])
    except OutriderError as err:
        add("golden tau", "FAIL", f"the head does not run here: {err}")
        return
    if "computes" not in golden:
        add("golden logits", "skipped", f"{GOLDEN} records no slot argmaxes or logits (format 1, before issue 43); "
                                        f"`{export_command}` records them")
    else:
        same = measured["measured_on"] == golden["measured_on"] and measured["settings"] == golden["settings"]
        ok, message = compare_computes(golden, measured, same)
        add("golden logits", "ok" if ok else "FAIL", message)
    ok, message = compare(golden, measured)
    add("golden tau", "ok" if ok else "FAIL", message)
