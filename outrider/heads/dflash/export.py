"""Write a DFlash head in the layouts z-lab's DFlash, vLLM and SGLang load (heads/dflash/format.py).

    export_dflash("runs/my-dflash", "out/my-dflash", "zlab", "smollm2-135m-instruct", dtype="bf16")

Each writes `config.json` (`format.config_json`), `model.safetensors` (z-lab's names, never
pickles) and `outrider_golden.json` (heads/dflash/golden.py). `zlab` and `sglang` read out through
the target's lm_head and size fc by the head's own hidden size, so a head with a reduced draft
vocabulary or another target hidden size is refused there in one line (`vllm` loads both). The
folder is written under a temporary name beside `out` and renamed when complete; an existing
non-empty `out` is refused before any work (as heads/eagle3/export.py).
"""

from __future__ import annotations

from pathlib import Path

from ...errors import ConfigError, ModelError
from .format import FORMATS, config_json, expected_shapes, misfit, read_config, read_tensors
from ..staging import DTYPE_NAMES, DTYPES, check_out
from ..staging import staged_head
from ..golden import PROMPTS, GoldenSettings, record, write_golden


def export_dflash(source: str | Path, out: str | Path, fmt: str, target: str | Path, *, dtype: str | None = None,
                  settings: GoldenSettings = GoldenSettings(), prompts=PROMPTS, golden: bool = True,
                  log=None) -> Path:
    """Write the DFlash head in folder `source` for `target` (catalog name or folder) into `out`
    in layout `fmt` (zlab, vllm, sglang), floats in `dtype` (bf16, fp16, fp32; None: as stored),
    with its golden tau; returns `out`."""
    from ...catalog.resolve import resolve_model
    from ...models.config import ModelConfig

    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt!r}: use one of {', '.join(FORMATS)}")
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: use bf16, fp16 or fp32 (or leave it out to keep the head's)")
    out = check_out(out)
    target_path = resolve_model(target)
    tcfg = ModelConfig.load(target_path)
    config = read_config(source)
    reason = misfit(config, tcfg)
    if reason:
        raise ModelError(f"the head does not fit target {target}: {reason}")
    if fmt != "vllm" and (config.draft_vocab_size is not None or config.target_hidden_size != config.hidden_size):
        raise ConfigError(f"--format {fmt} reads out through the target's lm_head and sizes fc by the head's hidden "
                          "size; this head has a reduced draft vocabulary or another target hidden size: export it "
                          "with --format vllm")
    stored = read_tensors(source)
    required, optional = expected_shapes(config, tcfg.num_layers)
    missing = [n for n in required if n not in stored]
    if missing:
        raise ModelError(f"the head lacks tensor(s) {', '.join(missing)}; it cannot be exported: re-train it")
    tensors = {}
    for name in [*required, *(n for n in optional if n in stored)]:
        t, shape = stored[name], required.get(name, optional.get(name))
        if tuple(t.shape) != shape:
            raise ModelError(f"the head's tensor {name} has shape {list(t.shape)} but its config says {list(shape)}; "
                             "the config and the weights disagree: fix the head before exporting it")
        if name not in ("d2t", "t2d") and dtype is not None:
            t = t.to(DTYPES[dtype])
        tensors[name] = t.contiguous()
    dropped = sorted(set(stored) - set(tensors))
    if dropped and log:
        log(f"left out tensor(s) that are no part of a DFlash head: {', '.join(dropped)}")
    dtype_name = DTYPE_NAMES.get(tensors["fc.weight"].dtype, str(tensors["fc.weight"].dtype).removeprefix("torch."))
    raw = config_json(config, fmt, dtype=dtype_name, num_target_layers=tcfg.num_layers,
                      max_positions=tcfg.max_position_embeddings)
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
        log(f"measuring the golden tau on {len(prompts)} prompts ({settings.device}, {settings.dtype})")
    golden = record(measure(folder, target_path, settings, prompts), str(target), Path(target_path),
                    [ModelConfig.load(target_path).architecture])
    write_golden(folder, golden)
    return golden
