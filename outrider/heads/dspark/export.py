"""Write a DSpark head in its one layout (heads/dspark/format.py: DeepSpec's config fields plus the
speculators fields for `dspark`), floats in one dtype, with its golden (heads/dspark/golden.py).

    export_dspark("runs/my-dspark", "out/my-dspark", "smollm2-135m-instruct", dtype="bf16")

Built in a staging folder and renamed when complete (heads/staging.py); an existing non-empty
`out` is refused before any work.
"""

from __future__ import annotations

from pathlib import Path

from ...errors import ConfigError, ModelError
from ..golden import PROMPTS, GoldenSettings, record, write_golden
from ..staging import DTYPE_NAMES, DTYPES, check_out, staged_head
from .format import config_json, expected_shapes, misfit, read_config, read_tensors

FORMATS = ("speculators",)  # DeepSpec's Qwen3DSparkModel fields + speculators' (one config holds both)


def export_dspark(source: str | Path, out: str | Path, target: str | Path, *, fmt: str = "speculators",
                  dtype: str | None = None, settings: GoldenSettings = GoldenSettings(), prompts=PROMPTS,
                  golden: bool = True, temperatures: tuple[float, ...] | None = None, log=None) -> Path:
    """Write the DSpark head in `source` for `target` (catalog name or folder) into `out`; every
    float tensor in `dtype` (bf16, fp16, fp32; None: as stored, made one dtype: the widest);
    `temperatures` replace the stored calibration. Returns `out`."""
    from ...catalog.resolve import resolve_model
    from ...models.config import ModelConfig

    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt!r}: use {', '.join(FORMATS)} (or gguf is not written for DSpark)")
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: use bf16, fp16 or fp32 (or leave it out to keep the head's)")
    out = check_out(out)
    target_path = resolve_model(target)
    tcfg = ModelConfig.load(target_path)
    spec = read_config(source)
    if temperatures is not None:
        from dataclasses import replace

        spec = replace(spec, temperatures=tuple(float(t) for t in temperatures))
    reason = misfit(spec, tcfg)
    if reason:
        raise ModelError(f"the head does not fit target {target}: {reason}")
    stored = read_tensors(source)
    required, optional = expected_shapes(spec, tcfg.num_layers)
    missing = [n for n in required if n not in stored]
    if missing:
        raise ModelError(f"the head lacks tensor(s) {', '.join(missing[:4])}; it cannot be exported: re-train it")
    floats = {stored[n].dtype for n in required if stored[n].is_floating_point()}
    want = DTYPES[dtype] if dtype is not None else max(floats, key=lambda d: d.itemsize)
    tensors = {}
    for name in [*required, *(n for n in optional if n in stored)]:
        t, shape = stored[name], required.get(name, optional.get(name))
        if tuple(t.shape) != shape:
            raise ModelError(f"the head's tensor {name} has shape {list(t.shape)} but its config says {list(shape)}; "
                             "fix the head before exporting it")
        tensors[name] = (t.to(want) if t.is_floating_point() else t).contiguous()
    raw = config_json(spec, dtype=DTYPE_NAMES.get(want, str(want)), num_target_layers=tcfg.num_layers,
                      verifier=str(target))
    with staged_head(out, raw, tensors) as work:
        if golden:
            write_record(work, target, target_path, settings, prompts, log)
    return out


def write_record(folder: Path, target, target_path: Path, settings: GoldenSettings = GoldenSettings(),
                 prompts=PROMPTS, log=None) -> dict:
    """Measure the head in `folder` on `target` and write its outrider_golden.json; returns the record."""
    from ...models.config import ModelConfig
    from .golden import measure

    if log:
        log(f"measuring the golden on {len(prompts)} prompts ({settings.device}, {settings.dtype})")
    golden = record(measure(folder, target_path, settings, prompts), str(target), Path(target_path),
                    [ModelConfig.load(target_path).architecture])
    write_golden(folder, golden)
    return golden
