"""The generation loop over token ids: prefill, then rounds until each sequence stops.

Autoregressive decoding is the round with a root-only tree; a drafter makes the trees larger.
Stopping (EOS, max new tokens, context, a caller's stop rule) truncates what a round committed,
so the output is exactly what plain decoding would have produced up to the same point.
`generate_ids` runs a fixed list of requests; the serving engine (engine/loop.py) runs the
same rounds and stopping rules for requests that come and go.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import ConfigError
from ..models.decoder import Decoder
from ..sampling import SamplingParams
from .round import Sequence
from ..spec.types import RoundStats


@dataclass
class Request:
    prompt_ids: list[int]
    max_new_tokens: int = 128
    params: SamplingParams = field(default_factory=SamplingParams)
    speculate: bool = True  # False: plain decoding for this request even when the engine drafts
    max_draft_tokens: int | None = None  # at most this many draft nodes per round (None: the controller's)
    ignore_eos: bool = False  # run on past end-of-sequence tokens (load tests)


@dataclass
class Finished:
    output_ids: list[int]
    finish_reason: str  # "eos", "length", "stop", "context" or "cancelled"
    stats: RoundStats
    prefill_s: float
    total_s: float


# on_commit(index, output_ids) -> None, or the number of output tokens to keep and stop there.
OnCommit = Callable[[int, list[int]], int | None]


def generate_ids(
    target: Decoder,
    requests: list[Request],
    eos_ids: set[int],
    *,
    max_len: int | None = None,
    speculation=None,
    on_commit: OnCommit | None = None,
) -> list[Finished]:
    """Generate for every request at once, one slot each. `speculation` (a spec.speculator.Speculator)
    drafts; without it every round is one autoregressive step.

    A thin loop over the serving engine (engine/loop.py) with every request admitted at
    once, every prompt prefilled in one forward, and a cache of `max_len` rows per slot."""
    from .loop import EngineLoop

    headroom = speculation.max_tree_size if speculation is not None else 1
    longest = max(len(r.prompt_ids) + r.max_new_tokens for r in requests)
    max_len = max_len or min(target.config.max_position_embeddings, longest + headroom)
    for i, r in enumerate(requests):
        check_request(r, max_len, f"prompt {i}", "pass a larger max_len")
    engine = EngineLoop(target, eos_ids, speculation, max_running=len(requests), max_len=max_len,
                        on_commit=on_commit)
    return engine.run_all(requests)  # request ids 0, 1, ...: on_commit's index


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


def with_seed(params: SamplingParams) -> SamplingParams:
    """`params` with a definite seed: its own, or one drawn from torch's global generator (so
    `torch.manual_seed` still makes unseeded runs repeatable). Every random draw of the request,
    the verifier's and a drafter's, is then a function of this seed and the output position."""
    if params.seed is not None:
        return params
    return dataclasses.replace(params, seed=int(torch.randint(0, 2**63 - 1, ())))


def stop_after_round(seq: Sequence, request: Request, new: int, eos_ids: set[int], cache, on_commit) -> str | None:
    """Truncate what this round committed (`new` tokens) at the first stopping point; say why.
    Tokens cut here were never output, so the stats do not count them as committed."""
    before = len(seq.tokens)
    reason = _stop_reason(seq, request, new, eos_ids, cache, on_commit)
    if len(seq.tokens) < before:
        _uncount_cut(seq.stats, len(seq.output))
    return reason


def _uncount_cut(stats, kept: int) -> None:
    """The output was cut to `kept` tokens (a limit, EOS or a stop string, possibly reaching back
    over earlier rounds): count as committed only those, and as rounds only the rounds that
    produced at least one of them, so tau is kept tokens per round that produced them."""
    rounds, done = 0, 0
    for size in stats.committed_by_round:
        if done >= kept:
            break
        done, rounds = done + size, rounds + 1
    stats.committed, stats.rounds = kept, rounds
    del stats.committed_by_round[rounds:]


def _stop_reason(seq: Sequence, request: Request, new: int, eos_ids: set[int], cache, on_commit) -> str | None:
    out = seq.output
    reason, keep = None, len(out)
    for i in range(len(out) - new, len(out)):
        if out[i] in eos_ids:
            reason, keep = "eos", i + 1
            break
    if keep >= request.max_new_tokens:
        reason = "eos" if reason and keep == request.max_new_tokens else "length"
        keep = request.max_new_tokens
    del seq.tokens[seq.prompt_len + keep:]
    if reason is None and cache.free_rows(seq.slot) < 1:
        reason = "context"
    if on_commit is not None:
        cut = on_commit(seq.seq_id, seq.output)
        if cut is not None:
            del seq.tokens[seq.prompt_len + cut:]
            reason = "stop"
    return reason
