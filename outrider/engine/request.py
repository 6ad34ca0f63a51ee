"""What a front end hands the engine (`Request`) and what it gets back (`Completion`).

Between the two, the engine keeps one record per request, its `Sequence` (engine/sequence.py),
from admission to the result; every front end (`LLM.generate`, `outrider bench`, `outrider
serve`) makes the same Request and reads the same Completion.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ConfigError
from ..sampling import SamplingParams
from ..spec.types import RoundStats

FINISH_REASONS = ("eos", "length", "stop", "context", "cancelled")


@dataclass
class Request:
    """Token ids in, with how to choose tokens and when to stop."""

    prompt_ids: list[int]
    max_new_tokens: int = 128
    params: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()  # stop strings: the text ends before the earliest (needs the engine's decode)
    speculate: bool = True  # False: plain decoding for this request even when the engine drafts
    max_draft_tokens: int | None = None  # at most this many draft nodes per round (None: the controller's)
    ignore_eos: bool = False  # run on past end-of-sequence tokens (load tests)


@dataclass
class Completion:
    """One request's output. `text` ends exactly before the earliest stop string found;
    `token_ids` are the output tokens that text came from, so when a stop string starts inside a
    token, that token is kept and its text runs past `text` (finish_reason "stop"). `text` is
    None where the engine has no tokenizer (token-level runs: the bench, tests).

    finish_reason: "eos", "length", "stop", "context" or "cancelled"; `stats`: the figures of
    engine/stats.py `summarize`; `round_stats`: the raw per-round counters they come from."""

    text: str | None
    token_ids: list[int]
    finish_reason: str
    stats: dict = field(default_factory=dict)
    round_stats: RoundStats = field(default_factory=RoundStats, repr=False)


def check_request(r: Request, max_len: int, what: str = "the prompt", larger: str = "raise the context") -> None:
    """Refuse a request that can never run in slots of `max_len` rows (one-line ConfigError)."""
    if not r.prompt_ids:
        raise ConfigError(f"{what} is empty: give at least one token of prompt")
    if len(r.prompt_ids) >= max_len:
        raise ConfigError(f"{what} has {len(r.prompt_ids)} tokens but the context holds {max_len}: "
                          f"shorten the prompt or {larger}")
    if r.max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be >= 1, got {r.max_new_tokens}")
    if r.max_draft_tokens is not None and r.max_draft_tokens < 0:
        raise ConfigError(f"max_draft_tokens must be >= 0 (0: no drafts), got {r.max_draft_tokens}")
