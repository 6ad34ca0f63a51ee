"""The generation loop over token ids: prefill, then rounds until each sequence stops.

Autoregressive decoding is the round with a root-only tree; a drafter makes the trees larger.
Stopping (EOS, max new tokens, context, a caller's stop rule) truncates what a round committed,
so the output is exactly what plain decoding would have produced up to the same point.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .errors import ConfigError
from .models.batch import pack
from .models.decoder import Decoder
from .sampling import SamplingParams
from .spec.round import Sequence, run_round
from .spec.random import PositionalRandom
from .spec.types import DraftTree, RoundStats
from .spec.verifiers import choose_verifier


@dataclass
class Request:
    prompt_ids: list[int]
    max_new_tokens: int = 128
    params: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class Finished:
    output_ids: list[int]
    finish_reason: str  # "eos", "length", "stop" or "context"
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
    """Generate for every request at once, one slot each. `speculation` (a spec.setup.Speculator)
    drafts; without it every round is one autoregressive step."""
    context = target.config.max_position_embeddings
    headroom = speculation.max_tree_size if speculation is not None else 1
    longest = max(len(r.prompt_ids) + r.max_new_tokens for r in requests)
    max_len = max_len or min(context, longest + headroom)
    for i, r in enumerate(requests):
        if not r.prompt_ids:
            raise ConfigError(f"prompt {i} is empty: give at least one token of prompt")
        if len(r.prompt_ids) >= max_len:
            raise ConfigError(
                f"prompt {i} has {len(r.prompt_ids)} tokens but the context holds {max_len}: "
                "shorten the prompt or pass a larger max_len"
            )
        if r.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {r.max_new_tokens}")
    start = time.perf_counter()
    cache = target.new_cache(len(requests), max_len)
    seqs = []
    for i, r in enumerate(requests):
        params = with_seed(r.params)
        verify = (speculation.verifier_for(params) if speculation is not None
                  else choose_verifier("chain", False, params).verifier)
        seqs.append(Sequence(i, i, list(r.prompt_ids), len(r.prompt_ids), params, PositionalRandom(params.seed), verify))
    _prefill(target, cache, seqs)
    if speculation is not None:
        for seq in seqs:
            speculation.start(seq)
    prefill_s = time.perf_counter() - start
    finished: dict[int, Finished] = {}
    active = list(seqs)
    if speculation is None:
        propose = lambda seq: DraftTree.root_only(seq.tokens[-1])  # noqa: E731
    else:
        propose = lambda seq: speculation.propose(seq, cache.free_rows(seq.slot))  # noqa: E731
    taps = speculation.hidden_layers if speculation is not None else ()
    while active:
        results, hidden = run_round(target, cache, active, propose, taps)
        still = []
        for seq, result in zip(active, results):
            reason = _stop(seq, requests[seq.seq_id], len(result.tokens), eos_ids, cache, on_commit)
            if speculation is not None:
                speculation.update(seq, result, hidden)
            if reason is None:
                still.append(seq)
            else:
                if speculation is not None:
                    speculation.finish(seq)
                finished[seq.seq_id] = Finished(seq.output, reason, seq.stats, prefill_s,
                                                time.perf_counter() - start)
        active = still
    return [finished[i] for i in range(len(seqs))]


def with_seed(params: SamplingParams) -> SamplingParams:
    """`params` with a definite seed: its own, or one drawn from torch's global generator (so
    `torch.manual_seed` still makes unseeded runs repeatable). Every random draw of the request,
    the verifier's and a drafter's, is then a function of this seed and the output position."""
    if params.seed is not None:
        return params
    return dataclasses.replace(params, seed=int(torch.randint(0, 2**63 - 1, ())))


def _prefill(target: Decoder, cache, seqs: list[Sequence]) -> None:
    """Write the K/V of every prompt token but the last (the first round's root)."""
    todo = [s for s in seqs if len(s.tokens) > 1]
    if not todo:
        return
    batch = pack([s.slot for s in todo], [0] * len(todo), [torch.tensor(s.tokens[:-1]) for s in todo],
                 logits="none", scratch_row=cache.scratch_row, device=target.device)
    target.forward(batch, cache)
    for s in todo:
        cache.set_length(s.slot, len(s.tokens) - 1)


def _stop(seq: Sequence, request: Request, new: int, eos_ids: set[int], cache, on_commit) -> str | None:
    """Truncate what this round committed (`new` tokens) at the first stopping point; say why.
    Tokens cut here were never output, so the stats do not count them as committed."""
    before = len(seq.tokens)
    reason = _stop_reason(seq, request, new, eos_ids, cache, on_commit)
    seq.stats.committed -= before - len(seq.tokens)
    return reason


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
