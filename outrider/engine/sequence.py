"""The one record the engine keeps per request, from `EngineLoop.add` to its Completion.

A `Sequence` holds what the round reads and writes (committed tokens, sampling, randomness, the
verifier, counters) and what the engine needs around it (the K/V slot and rows the scheduler
gave it, prefill progress, its text stream, timings). Drafters and controllers see it through
`seq_id`, `tokens`, `params`, `slot`; nothing else is copied out of it until `completion()`.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch

from ..sampling import SamplingParams
from ..spec.grammar import GrammarState
from ..spec.processing import PathProcessor
from ..spec.random import PositionalRandom
from ..spec.types import RoundStats
from ..spec.verifiers import Verifier
from .request import Completion, Request, TokenLogprob
from .stats import summarize
from .text_stream import TextStream


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request: Request
    tokens: list[int]  # committed: prompt + output so far
    prompt_len: int
    params: SamplingParams  # the request's, with a definite seed (`with_seed`)
    rng: PositionalRandom  # the request's randomness, by output position (spec/random.py)
    verify: Verifier  # exact for this sequence's drafts and sampling (spec/verifiers.py)
    speculate: bool = False  # drafts this round (the engine drafts and the request allows it)
    proposed: bool = False  # has had a proposal (a head's first writes the prompt's rows: not a round's time)
    text: TextStream | None = None  # its stable text and stop strings (None: no tokenizer)
    processor: PathProcessor | None = None  # logit bias and penalties (None: the params have none)
    grammar: GrammarState | None = None  # its grammar's state after the committed output (spec/grammar.py)
    allowed: torch.Tensor | None = None  # this round: bool [tree size, V], the grammar's tokens at each node
    logprobs: list[TokenLogprob] | None = None  # one a committed output token, when asked for
    prompt_logprobs: list[TokenLogprob | None] | None = None
    stats: RoundStats = field(default_factory=RoundStats)
    slot: int = -1  # its K/V slot; -1 while waiting (engine/scheduler.py)
    rows: int = 0  # K/V rows reserved while running
    prefilled: int = 0  # prompt tokens whose K/V is written
    decoding: bool = False  # its prompt is in the cache: it takes part in rounds
    cancelled: bool = False
    added_at: float = field(default_factory=time.perf_counter)
    admitted_at: float = 0.0
    prefill_s: float = 0.0
    prompt_hidden: list = field(default_factory=list)  # prefill taps per chunk (layer -> [n, E]) for the drafter
    looked_up: bool = False  # the prefix cache was asked for its prompt (engine/prefix_cache.py)
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    cacheable: bool = True  # its rows are a whole prefill's bits (a prefill off the exact path: not kept)
    resume_at: int = 0  # preempted (engine/paging.py): tokens its K/V is recomputed for when admitted again
    preemptions: int = 0

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    def completion(self, reason: str, error: str | None = None) -> tuple[Completion, str]:
        """The finished result, and the text still held back (shown last: an incomplete
        character, a tail that could have begun a stop string). The stopping rules have cut the
        tokens already (engine/stopping.py); a cancelled or failed request keeps what it committed."""
        ids, rest = self.output, ""
        if self.text is not None:
            rest = self.text.add(ids[self.text.fed:]) + self.text.finish()
        total = time.perf_counter() - (self.admitted_at or self.added_at)
        stats = summarize(self.stats, len(ids), self.prefill_s, total)
        text = self.text.text if self.text is not None else None
        return Completion(text, ids, reason, stats, self.stats, self.logprobs, self.prompt_logprobs, error,
                          self.cached_tokens), rest


def with_seed(params: SamplingParams) -> SamplingParams:
    """`params` with a definite seed: its own, or one drawn from torch's global generator (so
    `torch.manual_seed` still makes unseeded runs repeatable). Every random draw of the request,
    the verifier's and a drafter's, is then a function of this seed and the output position."""
    if params.seed is not None:
        return params
    return dataclasses.replace(params, seed=int(torch.randint(0, 2**63 - 1, ())))
