"""What a front end hands the engine (`Request`) and what it gets back (`Completion`).

Between the two, the engine keeps one record per request, its `Sequence` (engine/sequence.py),
from admission to the result; every front end (`LLM.generate`, `outrider bench`, `outrider
serve`) makes the same Request and reads the same Completion.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ConfigError
from ..sampling import SamplingParams
from ..spec.grammar import Grammar
from ..spec.types import RoundStats

FINISH_REASONS = ("eos", "length", "stop", "context", "cancelled", "error")


@dataclass
class Request:
    """Token ids in, with how to choose tokens and when to stop.

    params: the target distribution and its sampling (sampling.py: temperature, top-k/p, min-p,
    penalties, logit bias, seed); stop / stop_token_ids: end the output at a stop string (cut
    before it) or after a stop token (kept, finish_reason "stop"); logprobs: with each committed
    token, the target's log-probability of it and of the `logprobs` likeliest tokens at its
    position (0: the token's alone); prompt_logprobs: the same for the prompt's tokens (the
    first has none); prefill_from: the id of an earlier request with the same prompt whose
    prompt K/V this one may copy instead of computing (n samples sharing one prefill); grammar:
    constrains the target's distribution (spec/grammar.py: JSON schema, Lark, regex);
    grammar_drafting: prune drafts at forbidden tokens and draft forced tokens for free (off:
    the grammar only masks the target's logits, to measure what grammar-aware drafting gives)."""

    prompt_ids: list[int]
    max_new_tokens: int = 128
    params: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()  # stop strings: the text ends before the earliest (needs the engine's decode)
    speculate: bool = True  # False: plain decoding for this request even when the engine drafts
    max_draft_tokens: int | None = None  # at most this many draft nodes per round (None: the controller's)
    ignore_eos: bool = False  # run on past end-of-sequence tokens (load tests)
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None  # None: none; N >= 0: the chosen token's and the top N
    prompt_logprobs: int | None = None
    prefill_from: int | None = None
    grammar: Grammar | None = None
    grammar_drafting: bool = True
    # rows that replace the prompt's token embeddings at these positions: (positions long [K], rows
    # [K, E]): a vision-language model's image features (models/image_prompt.py prompt_embeds)
    prompt_embeds: tuple | None = None


@dataclass(frozen=True)
class TokenLogprob:
    """The target's log-probability of a token at its position (its raw distribution, before the
    bias, penalties and warp, as vLLM reports by default), and the likeliest tokens there."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), likeliest first


@dataclass
class Completion:
    """One request's output. `text` ends exactly before the earliest stop string found;
    `token_ids` are the output tokens that text came from, so when a stop string starts inside a
    token, that token is kept and its text runs past `text` (finish_reason "stop"). `text` is
    None where the engine has no tokenizer (token-level runs: the bench, tests).

    finish_reason: "eos", "length", "stop", "context", "cancelled" or "error" (the request
    failed alone: `error` says why; the engine went on with the others); `stats`: the figures of
    engine/stats.py `summarize`; `round_stats`: the raw per-round counters they come from;
    `logprobs` / `prompt_logprobs`: one TokenLogprob a token when the request asked for them;
    `cached_tokens`: prompt tokens whose K/V the prefix cache gave (engine/prefix_cache.py)."""

    text: str | None
    token_ids: list[int]
    finish_reason: str
    stats: dict = field(default_factory=dict)
    round_stats: RoundStats = field(default_factory=RoundStats, repr=False)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    error: str | None = None
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache (OpenAI's usage.cached_tokens)


def check_request(r: Request, max_len: int, what: str = "the prompt", larger: str = "raise the context",
                  vocab: int | None = None) -> None:
    """Refuse a request that can never run in slots of `max_len` rows, or names a token id
    outside a `vocab`-token vocabulary (one-line ConfigError)."""
    if not r.prompt_ids:
        raise ConfigError(f"{what} is empty: give at least one token of prompt")
    if vocab is not None:
        for name, ids in (("prompt token id", r.prompt_ids), ("stop_token_ids entry", r.stop_token_ids),
                          ("logit_bias token id", [t for t, _ in r.params.logit_bias])):
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise ConfigError(f"{name} {bad} is outside the model's vocabulary of {vocab} tokens "
                                  f"(ids 0..{vocab - 1})")
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(r, name)
        if value is not None and not (0 <= value <= (vocab or value)):
            raise ConfigError(f"{name} must be between 0 and the vocabulary's size, got {value}")
    if len(r.prompt_ids) >= max_len:
        raise ConfigError(f"{what} has {len(r.prompt_ids)} tokens but the context holds {max_len}: "
                          f"shorten the prompt or {larger}")
    if r.prompt_embeds is not None and len(r.prompt_embeds[0]) and int(r.prompt_embeds[0].max()) >= len(r.prompt_ids) - 1:
        raise ConfigError("prompt_embeds reach the prompt's last token: it must be a token of its own (it is the "
                          "first round's root)")
    if r.max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be >= 1, got {r.max_new_tokens}")
    if r.max_draft_tokens is not None and r.max_draft_tokens < 0:
        raise ConfigError(f"max_draft_tokens must be >= 0 (0: no drafts), got {r.max_draft_tokens}")
