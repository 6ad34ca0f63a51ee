"""A byte-level BPE tokenizer cut to its first N ids (a small model's vocabulary, same ids as the original).

A byte-pair tokenizer's ids follow its merge order, so tokens 0..N-1 are the added tokens, the 256
byte symbols and the first merges. Keeping those and the merges whose parts and result all lie
below N gives a tokenizer that still spells any text (down to single bytes) and gives every token
it emits the id the original gives it: a model trained with it speaks SmolLM2's ids 0..N-1.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ..errors import ConfigError

COPIED = ("tokenizer_config.json", "special_tokens_map.json")


def cut_tokenizer_json(raw: dict, n: int) -> dict:
    """tokenizer.json's dict -> the same tokenizer over ids 0..n-1."""
    model = raw.get("model", {})
    if model.get("type") != "BPE":
        raise ConfigError(f"a vocabulary cut needs a BPE tokenizer, this one is {model.get('type')!r}")
    vocab = {t: i for t, i in model["vocab"].items() if i < n}
    if len(vocab) != n:
        raise ConfigError(f"the tokenizer's ids 0..{n - 1} are not all in its vocabulary")
    added = [t for t in raw.get("added_tokens", []) if t["id"] < n]
    if len(added) != len(raw.get("added_tokens", [])):
        raise ConfigError(f"the tokenizer adds tokens at ids >= {n}: cut to more ids")
    merges = []
    for m in model["merges"]:
        a, b = m if isinstance(m, list) else m.split(" ", 1)
        if a in vocab and b in vocab and a + b in vocab:
            merges.append(m)
    alphabet = _byte_symbols() & model["vocab"].keys()  # the ones the original has (not 0xC0, 0xF5.. in UTF-8)
    if not alphabet <= vocab.keys():
        raise ConfigError(f"ids 0..{n - 1} miss some of the 256 byte symbols: cut to more ids")
    return {**raw, "added_tokens": added, "model": {**model, "vocab": vocab, "merges": merges}}


def cut_tokenizer(source: Path, n: int, folder: Path) -> None:
    """Write the cut of `source`'s tokenizer.json (and its tokenizer_config.json) into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    raw = json.loads((Path(source) / "tokenizer.json").read_text())
    (folder / "tokenizer.json").write_text(json.dumps(cut_tokenizer_json(raw, n), ensure_ascii=False) + "\n")
    for name in COPIED:
        if (Path(source) / name).is_file():
            shutil.copy2(Path(source) / name, folder / name)


def _byte_symbols() -> set[str]:
    """The 256 symbols byte-level BPE writes bytes as (GPT-2's printable mapping)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    extra = [b for b in range(256) if b not in printable]
    return {chr(b) for b in printable} | {chr(256 + i) for i in range(len(extra))}
