"""One unit of training text (a source's item), before tokenization (train/data.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Item:
    """One unit of training text. kind "text": `text` (or the file `path`) is raw text;
    "prompt": `text` is a completion prompt; "chat": `messages` (role/content dicts)."""
    id: str
    kind: str
    text: str | None = None
    path: str | None = None
    messages: tuple | None = None
    response: str | None = None

    def raw_text(self) -> str:
        return self.text if self.path is None else Path(self.path).read_text(encoding="utf-8", errors="replace")
