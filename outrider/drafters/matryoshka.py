"""`--drafter matryoshka[:K]`: a Matryoshka suite's K-th smallest slice drafts for the suite (default
K = 1, the smallest), with the suite's one weight set (models/matryoshka.py).

The target must be a suite (its config.json lists `matryoshka.slices`, as `outrider train
matryoshka` writes it). The slice runs as a draft model of its own (ModelDrafter, with a K/V cache
of its own: its heads are a prefix of the target's, so the target's cache rows hold more heads than
it reads and it cannot share them), built from the target's tensors (models/matryoshka.py
slice_decoder): no second file, and the slice is the largest model cut to prefixes. Lossless: the
target verifies every draft.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError, ModelError
from ..models.matryoshka import slice_decoder, slices_of
from .model import ModelDrafter
from .registry import DrafterEntry, register


def parse_argument(text: str) -> int:
    if not text:
        return 1
    try:
        k = int(text)
    except ValueError:
        k = 0
    if k < 1:
        raise ConfigError("matryoshka:K needs a slice number K >= 1 (1: the smallest)")
    return k


def check_fits(k: int, target_config, target_path: Path) -> str | None:
    try:
        slices = slices_of(target_path)
    except ModelError as err:
        return str(err)
    if not slices:
        return ("the target is not a Matryoshka suite (its config.json lists no matryoshka slices; "
                "`outrider train matryoshka` writes one)")
    if k >= len(slices):
        return (f"the suite has {len(slices)} slices, the last being the target itself, so matryoshka:K needs K "
                f"below {len(slices)}")
    return None


def build(k: int, shape, target, target_path: Path) -> ModelDrafter:
    reason = check_fits(k, target.config, target_path)
    if reason is not None:
        raise ConfigError(f"matryoshka:{k}: {reason}")
    s = slices_of(target_path)[k - 1]
    return ModelDrafter(slice_decoder(target, s), shape, name=f"matryoshka:{k}",
                        target_vocab=target.config.vocab_size)


register(DrafterEntry("matryoshka", "matryoshka[:K]", ModelDrafter.capabilities, build=build,
                      parse_argument=parse_argument, check_fits=check_fits))
