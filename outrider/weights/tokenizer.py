"""A model folder's tokenizer (transformers' fast tokenizer, no remote code) and its end ids."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import ModelError


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    try:
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except (OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ModelError(f"{path}: cannot load the tokenizer ({first}); re-pull the model") from None


def eos_ids_of(path: Path, tokenizer) -> set[int]:
    """Every end-of-generation id: generation_config.json's and the tokenizer's EOS."""
    ids: set[int] = set()
    gen = Path(path) / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
