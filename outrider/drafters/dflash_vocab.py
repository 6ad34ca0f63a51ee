"""`dflash:NAME,vocab=N`: a DFlash head reading out only N tokens of the target's output head.

A head trained on the target's whole vocabulary shares the target's output head, so each block
forward multiplies its B-1 rows by all V rows of it: on SmolLM2-135M (V 49,152, the output head in
q8_0 beside a q4 target) that is 5.2 of the block's 8.7 ms on one thread of an AMD EPYC Zen 5,
measured 2026-12-03. `vocab=N` keeps the rows of token ids 0..N-1 and the tokenizer's added tokens
(a byte-pair tokenizer's low ids are its common tokens: the `draft-model:NAME,vocab=N` rule) as the
head's own readout, in the target's output head's quantization: the block then proposes no other
token. The logits of the kept tokens are the same numbers as before (the same rows), so where the
full head's argmax is kept, so is the draft; the target still verifies every draft, so the output
never changes.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError
from ..heads.dflash.vocab import cut_readout
from .draft_model import draft_vocab_ids


def parse_vocab(text: str | None, drafter: str = "dflash") -> int | None:
    if text is None:
        return None
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(f"vocab={text!r}: give a positive number of token ids, as in {drafter}:NAME,vocab=8192")
    return int(text)


def reduce_readout(head, target_path: Path, n: int):
    """The head with its readout cut to the ids `draft_vocab_ids` keeps (a new DFlashHead,
    heads/dflash/vocab.py; the target's own output head untouched)."""
    c = head.config
    if head.w.draft_to_target is not None:
        raise ConfigError("vocab=: this DFlash head already reads out its own draft vocabulary "
                          f"({c.draft_vocab_size} tokens); drop vocab=")
    return cut_readout(head, draft_vocab_ids(target_path, n, c.vocab_size))
