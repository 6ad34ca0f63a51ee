"""`outrider check-head DIR` for a DFlash head: does the folder conform, and draft as recorded?

One `Check` a line (heads/checks.py), in this order:

    layout          a DFlash head (z-lab's DFlashDraftModel config); which engines load it
    weights file    model.safetensors is there and whole (else its tensor checks are skipped)
    config fields   the fields z-lab's, vLLM's and SGLang's loaders read, with their JSON types
    target          the head reads this target's hidden size and vocabulary
    tensors         z-lab's names, shapes against the config and the target, float dtypes (d2t
                    int64, t2d bool), all one float dtype and the config's torch_dtype; nothing
                    missing, nothing extra (SGLang would ignore it)
    vocab map       a reduced vocabulary's d2t and t2d invert each other
    mask token      dflash_config.mask_token_id is a token of the target
    layer ids       target_layer_ids (DFlash's convention) are layers of the target it was made for
    block size      block_size is the one the golden was recorded with (the weights do not hold
                    it: a head trained on blocks of 8 runs blocks of 16 without complaint)
    golden logits   what the head computes on the golden's fixed inputs (heads/golden_compute.py)
    golden tau      outrider_golden.json re-measured (heads/dflash/golden.py)
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from ...errors import OutriderError
from ..checks import (FLOATS, Check, config_check, dtype_problems, golden_last, shape_problems, target_of,
                      weights_check)
from ..golden import GOLDEN, read_golden
from .format import WHAT, expected_shapes, misfit, read_config
from ..vocab_map import draft_to_target
from ..files import read_raw

DFLASH_FIELDS = (  # what z-lab's DFlashDraftModel, vLLM's DFlashQwen3ForCausalLM and SGLang's DFlashDraftModel read
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
    ("dflash_config", "dict", True),
    ("draft_vocab_size", "int|None", False),
    ("target_hidden_size", "int|None", False),
    ("eagle_aux_hidden_state_layer_ids", "list[int]", False),
)


def check_dflash(folder: str | Path, target: str | Path, *, device: str | None = None,
                 golden: bool = True) -> list[Check]:
    """Every check of the module docstring on the DFlash head in `folder` for `target`."""
    from .golden import measure

    folder = Path(folder)
    checks: list[Check] = []
    add = lambda *args: checks.append(Check(*args)) or checks[-1]  # noqa: E731
    try:
        raw = read_raw(folder, what=WHAT)
    except OutriderError as err:
        add("layout", "FAIL", str(err))
        return checks
    reduced = raw.get("draft_vocab_size") not in (None, raw.get("vocab_size"))
    add("layout", "ok", "dflash: z-lab's DFlashDraftModel, for " + ("vLLM only (a reduced draft vocabulary)"
                                                                    if reduced else "z-lab's DFlash, vLLM and SGLang"))
    header = weights_check(folder, add, WHAT)
    config = config_check(folder, raw, DFLASH_FIELDS, read_config,
                          lambda c: f"L {c.num_layers}, B {c.block_size}, H {c.hidden_size}", add)
    target_path, tcfg = target_of(target, add)
    if config is None or tcfg is None:
        for name in ("target", "tensors", "vocab map", "mask token", "layer ids")[0 if tcfg is not None else 1:]:
            add(name, "skipped", "needs a readable config.json and target")
    else:
        _target(config, tcfg, target, add)
        _tensors(config, tcfg, header, raw, add)
        _vocab(folder, config, header, add)
        _mask_and_layers(config, tcfg, add)
    _block_size(folder, config, add)
    golden_last(checks, add, golden, folder, target_path, device, measure, "outrider export dflash")
    return checks


def _target(config, tcfg, target, add) -> None:
    sizes = dataclasses.replace(config, target_layer_ids=(0,), mask_token_id=0, num_target_layers=None)
    reason = misfit(sizes, tcfg)  # the ids and the mask token: their own checks
    if reason:
        add("target", "FAIL", reason)
    else:
        add("target", "ok", f"{target}: hidden {tcfg.hidden_size}, vocab {tcfg.vocab_size}, {tcfg.num_layers} layers")


def _tensors(config, tcfg, header: dict | None, raw: dict, add) -> None:
    if header is None:
        add("tensors", "skipped", "needs a readable model.safetensors (weights file)")
        return
    required, optional = expected_shapes(config, tcfg.num_layers)
    problems = shape_problems(header, required, optional, "not part of a DFlash head; SGLang would ignore it", ignore=("d2t", "t2d"))
    for name, (_, dtype) in header.items():
        want = {"d2t": (torch.int64,), "t2d": (torch.bool,)}.get(name, FLOATS)
        if dtype not in want:
            problems.append(f"{name} is {dtype}, engines expect {' or '.join(str(w) for w in want)}")
    problems += dtype_problems(header, raw)
    if problems:
        add("tensors", "FAIL", f"{'; '.join(problems)}: re-export the head with `outrider export dflash`")
    else:
        add("tensors", "ok", f"{len(header)} tensors, {config.num_layers} layer(s), fc reads "
                             f"{len(config.layer_ids(tcfg.num_layers))} x {config.target_hidden_size}")


def _vocab(folder: Path, config, header: dict | None, add) -> None:
    if config.draft_vocab_size is None:
        add("vocab map", "skipped", "no draft vocabulary: the head reads out through the target's lm_head")
        return
    if header is None or "d2t" not in header or "t2d" not in header:
        add("vocab map", "FAIL", "d2t or t2d is missing; re-export the head with its draft vocabulary maps")
        return
    from safetensors import safe_open

    try:
        with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
            ids = draft_to_target(f.get_tensor("d2t"), f.get_tensor("t2d"), str(folder))
    except OutriderError as err:
        add("vocab map", "FAIL", str(err))
        return
    add("vocab map", "ok", f"{ids.numel()} draft tokens, d2t inverts t2d")


def _mask_and_layers(config, tcfg, add) -> None:
    mask = config.mask_token_id
    if 0 <= mask < tcfg.vocab_size:
        add("mask token", "ok", f"id {mask} of {tcfg.vocab_size}")
    else:
        add("mask token", "FAIL", f"dflash_config.mask_token_id {mask} is outside the target's vocabulary "
                                  f"(0..{tcfg.vocab_size - 1}); set it to a token of this target")
    reason = misfit(dataclasses.replace(config, mask_token_id=0), tcfg)
    ids = list(config.layer_ids(tcfg.num_layers))
    if reason:
        add("layer ids", "FAIL", reason)
    else:
        add("layer ids", "ok", f"{ids} (DFlash's convention) = hidden states {[i + 1 for i in ids]} of "
                               f"{tcfg.num_layers} layers")


def _block_size(folder: Path, config, add) -> None:
    if config is None:
        add("block size", "skipped", "needs a readable config.json")
        return
    try:
        golden = read_golden(folder)
        recorded = None if golden is None else int(golden["settings"]["depth"]) + 1  # the golden's chain: B-1
    except (ValueError, OSError, KeyError, TypeError):
        recorded = None  # the golden check says it is unreadable
    if recorded is None:
        add("block size", "skipped", f"no readable {GOLDEN} to hold block_size {config.block_size} against")
        return
    if recorded != config.block_size:
        add("block size", "FAIL", f"config.json's block_size is {config.block_size} but the head was exported and "
                                  f"its golden recorded with blocks of {recorded}; set block_size back to {recorded} "
                                  "or re-export the head")
    else:
        add("block size", "ok", f"{config.block_size}, as recorded in {GOLDEN}")
