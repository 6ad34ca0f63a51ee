"""`--drafter draft-model:NAME`: an independent, smaller model of the target's family drafts.

NAME is a catalog name or a model folder. The draft model must map text to the same token ids
as the target (same tokenizer), which is checked from the two tokenizer.json files before any
weights load. It drafts with `ModelDrafter` (model.py) and declares what that class declares.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import ConfigError
from .model import ModelDrafter
from .registry import DrafterEntry, register


def parse_argument(text: str) -> str:
    if not text:
        raise ConfigError("draft-model:NAME needs a model name or folder after the colon")
    return text


def models_needed(name: str) -> tuple[str, ...]:
    return (name,)


def check_fits(name: str, target_config, target_path: Path) -> str | None:
    from ..models.catalog import resolve_model

    return tokenizer_mismatch(target_path, resolve_model(name))


def build(name: str, shape, target, target_path: Path) -> ModelDrafter:
    from ..models.catalog import resolve_model
    from ..models.loader import load_decoder

    draft = load_decoder(resolve_model(name), target.device, target.dtype)
    return ModelDrafter(draft, shape, name=f"draft-model:{name}", target_vocab=target.config.vocab_size)


def tokenizer_mismatch(target_path: Path, draft_path: Path) -> str | None:
    """A reason the two folders' tokenizers differ, or None when they map text to the same ids."""
    def vocab(folder: Path):
        path = Path(folder) / "tokenizer.json"
        if not path.exists():
            return None
        raw = json.loads(path.read_text())
        added = sorted((t["id"], t["content"]) for t in raw.get("added_tokens", []))
        return raw.get("model", {}).get("type"), raw.get("model", {}).get("vocab"), added

    a, b = vocab(target_path), vocab(draft_path)
    if a is None or b is None:
        return "a tokenizer.json is missing, so the vocabularies cannot be compared"
    if a != b:
        size_a, size_b = len(a[1] or {}), len(b[1] or {})
        return f"its tokenizer differs from the target's ({size_b} vs {size_a} tokens); use a model of the same family"
    return None


register(DrafterEntry("draft-model", "draft-model:NAME", ModelDrafter.capabilities, build=build,
                      parse_argument=parse_argument, models_needed=models_needed, check_fits=check_fits))
