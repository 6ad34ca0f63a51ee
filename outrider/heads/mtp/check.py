"""`outrider check-head DIR` for an MTP head: does the folder conform, and draft as recorded?

One `Check` a line (heads/checks.py): layout, weights file, config fields (the ones vLLM's
DeepSeek MTP and our loader read, with their JSON types), target (hidden size, vocabulary, layer
count: the module is stored as layer N), tensors (names, shapes, float dtypes, nothing missing or
extra), golden logits and tau (heads/mtp/golden.py).
"""

from __future__ import annotations

from pathlib import Path

from ...errors import OutriderError
from ..checks import (FLOATS, Check, config_check, dtype_problems, fit_check, golden_last, shape_problems,
                      target_of, weights_check)
from ..files import read_raw
from .format import WHAT, expected_shapes, misfit, read_config

MTP_FIELDS = (
    ("num_hidden_layers", "int", True),
    ("num_nextn_predict_layers", "int", True),
    ("hidden_size", "int", True),
    ("intermediate_size", "int", True),
    ("num_attention_heads", "int", True),
    ("num_key_value_heads", "int", False),
    ("head_dim", "int", False),
    ("vocab_size", "int", True),
    ("rms_norm_eps", "float", False),
    ("rope_theta", "float", False),
)


def check_mtp(folder: str | Path, target: str | Path, *, device: str | None = None, golden: bool = True) -> list[Check]:
    from .golden import measure

    folder = Path(folder)
    checks: list[Check] = []
    add = lambda *args: checks.append(Check(*args)) or checks[-1]  # noqa: E731
    try:
        raw = read_raw(folder, what=WHAT)
    except OutriderError as err:
        add("layout", "FAIL", str(err))
        return checks
    add("layout", "ok", "mtp: DeepSeek-V3's MTP module as layer N (vLLM's deepseek_mtp names)")
    header = weights_check(folder, add, WHAT)
    config = config_check(folder, raw, MTP_FIELDS, read_config,
                          lambda c: f"layer {c.num_target_layers}, H {c.hidden_size}", add)
    target_path, tcfg = target_of(target, add)
    if config is None or tcfg is None:
        for name in ("target", "tensors")[0 if tcfg is not None else 1:]:
            add(name, "skipped", "needs a readable config.json and target")
    else:
        fit_check(config, tcfg, target, misfit, add)
        _tensors(config, header, raw, add)
    golden_last(checks, add, golden, folder, target_path, device, measure, "outrider export mtp")
    return checks


def _tensors(config, header: dict | None, raw: dict, add) -> None:
    if header is None:
        add("tensors", "skipped", "needs a readable model.safetensors (weights file)")
        return
    required, optional = expected_shapes(config)
    problems = shape_problems(header, required, optional, "not part of an MTP module")
    problems += [f"{name} is {dtype}, engines expect a float" for name, (_, dtype) in header.items()
                 if dtype not in FLOATS]
    problems += dtype_problems(header, raw)
    if problems:
        add("tensors", "FAIL", f"{'; '.join(problems)}: re-export the head with `outrider export mtp`")
    else:
        add("tensors", "ok", f"{len(header)} tensors of layer {config.num_target_layers}")
