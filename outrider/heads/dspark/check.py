"""`outrider check-head DIR` for a DSpark head: does the folder conform, and draft as recorded?

One `Check` a line (heads/checks.py), in this order:

    layout          a DSpark head (DeepSpec's Qwen3DSparkModel config, speculators type dspark)
    weights file    model.safetensors is there and whole
    config fields   the fields DeepSpec's and a speculators loader read, with their JSON types
    target          the head reads this target's hidden size and vocabulary, its mask token and
                    layer ids are the target's
    tensors         names and shapes against the config (backbone, Markov head of its variant and
                    rank, confidence head), float dtypes all one and the config's torch_dtype,
                    nothing missing, nothing extra
    calibration     dspark_config.temperatures: one positive temperature a position
    block size      block_size (gamma) is the one the golden was recorded with
    golden logits   the slots' argmaxes and logits on the golden's fixed inputs (Markov head included)
    golden tau      outrider_golden.json re-measured (heads/dspark/golden.py)
"""

from __future__ import annotations

from pathlib import Path

from ...errors import OutriderError
from ..checks import (FLOATS, Check, config_check, dtype_problems, fit_check, golden_last, shape_problems,
                      target_of, weights_check)
from ..files import read_raw
from ..golden import GOLDEN, read_golden
from .format import WHAT, expected_shapes, misfit, read_config

DSPARK_FIELDS = (
    ("architectures", "list[str]", True),
    ("num_hidden_layers", "int", True),
    ("hidden_size", "int", True),
    ("intermediate_size", "int", True),
    ("num_attention_heads", "int", True),
    ("num_key_value_heads", "int", False),
    ("head_dim", "int", False),
    ("vocab_size", "int", True),
    ("rms_norm_eps", "float", False),
    ("rope_theta", "float", False),
    ("num_target_layers", "int", True),
    ("block_size", "int", True),
    ("mask_token_id", "int", True),
    ("target_layer_ids", "list[int]", True),
    ("enable_confidence_head", "bool", True),
    ("confidence_head_with_markov", "bool", True),
    ("markov_rank", "int", True),
    ("markov_head_type", "str", True),
    ("speculators_model_type", "str", True),
    ("speculators_config", "dict", True),
    ("dspark_config", "dict", False),
    ("draft_vocab_size", "int|None", False),
)


def check(folder: str | Path, target: str | Path, *, device: str | None = None, golden: bool = True) -> list[Check]:
    """Every check of the module docstring on the DSpark head in `folder` for `target`."""
    from .golden import measure

    folder = Path(folder)
    checks: list[Check] = []
    add = lambda *args: checks.append(Check(*args)) or checks[-1]  # noqa: E731
    try:
        raw = read_raw(folder, what=WHAT)
    except OutriderError as err:
        add("layout", "FAIL", str(err))
        return checks
    add("layout", "ok", "dspark: DeepSpec's Qwen3DSparkModel fields + speculators_model_type dspark (assumed layout)")
    header = weights_check(folder, add, WHAT)
    spec = config_check(folder, raw, DSPARK_FIELDS, read_config,
                        lambda c: f"gamma {c.gamma}, markov {c.markov_variant} r {c.markov_rank}", add)
    target_path, tcfg = target_of(target, add)
    if spec is None or tcfg is None:
        for name in ("target", "tensors")[0 if tcfg is not None else 1:]:
            add(name, "skipped", "needs a readable config.json and target")
    else:
        fit_check(spec, tcfg, target, misfit, add)
        _tensors(spec, tcfg, header, raw, add)
    _calibration(raw, spec, add)
    _block_size(folder, spec, add)
    golden_last(checks, add, golden, folder, target_path, device, measure, "outrider export dspark")
    return checks


def _tensors(spec, tcfg, header: dict | None, raw: dict, add) -> None:
    if header is None:
        add("tensors", "skipped", "needs a readable model.safetensors (weights file)")
        return
    required, optional = expected_shapes(spec, tcfg.num_layers)
    problems = shape_problems(header, required, optional, "not part of a DSpark head of this variant")
    import torch

    for name, (_, dtype) in header.items():
        want = {"d2t": (torch.int64,), "t2d": (torch.bool,)}.get(name, FLOATS)
        if dtype not in want:
            problems.append(f"{name} is {dtype}, engines expect {' or '.join(str(w) for w in want)}")
    problems += dtype_problems(header, raw)
    if problems:
        add("tensors", "FAIL", f"{'; '.join(problems)}: re-export the head with `outrider export dspark`")
    else:
        add("tensors", "ok", f"{len(header)} tensors, markov {spec.markov_variant} rank {spec.markov_rank}")


def _calibration(raw: dict, spec, add) -> None:
    if spec is None:
        add("calibration", "skipped", "needs a readable config.json")
        return
    temps = list(spec.temperatures)
    if not temps:
        add("calibration", "ok", "no temperatures: the confidence head as trained (T = 1)")
    else:
        add("calibration", "ok", "T " + ", ".join(f"{t:.2f}" for t in temps))


def _block_size(folder: Path, spec, add) -> None:
    if spec is None:
        add("block size", "skipped", "needs a readable config.json")
        return
    try:
        golden = read_golden(folder)
        recorded = None if golden is None else int(golden["settings"]["depth"])  # the golden's chain: gamma
    except (ValueError, OSError, KeyError, TypeError):
        recorded = None
    if recorded is None:
        add("block size", "skipped", f"no readable {GOLDEN} to hold block_size {spec.gamma} against")
    elif recorded != spec.gamma:
        add("block size", "FAIL", f"config.json's block_size is {spec.gamma} but the head's golden was recorded with "
                                  f"chains of {recorded}; set block_size back to {recorded} or re-export the head")
    else:
        add("block size", "ok", f"{spec.gamma}, as recorded in {GOLDEN}")
