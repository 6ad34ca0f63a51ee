"""Run one method over a list of prompts, one request at a time, and keep every raw figure.

Every method sees the same prompt ids, stops at the model's end-of-generation tokens or after
the same number of new tokens, in the same process; the lossless audit compares token for token.
Speed is tokens per second of wall time, prefill included, for every method alike.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..engine.generate import generate_ids
from .expert_budget import mb_per_token
from ..engine.request import Request
from ..models.decoder import Decoder
from ..sampling import SamplingParams


@dataclass
class PromptRun:
    output_ids: list[int]
    seconds: float
    stats: dict = field(default_factory=dict)


def run_ours(target: Decoder, speculator, prompt_ids: list[int], max_new_tokens: int,
             eos_ids: set[int] = frozenset(), params: SamplingParams | None = None) -> PromptRun:
    """params: None is greedy; a bench that samples passes its own (bench/sampling.py)."""
    request = Request(prompt_ids, max_new_tokens) if params is None else Request(prompt_ids, max_new_tokens, params)
    start = time.perf_counter()
    done = generate_ids(target, [request], set(eos_ids), speculation=speculator)[0]
    seconds = time.perf_counter() - start
    return PromptRun(done.token_ids, seconds, done.stats)


def run_transformers(model, prompt_ids: list[int], max_new_tokens: int, assistant=None,
                     prompt_lookup: int | None = None, fixed_length: bool = False,
                     sampling: tuple[float, float, int] | None = None) -> PromptRun:
    """transformers' generate (plain, assisted by a draft model, or prompt lookup), greedy.

    fixed_length: suppress end-of-generation tokens so exactly max_new_tokens come out (a decode
    benchmark's equal work); otherwise it stops at the model's EOS like our runs do.
    sampling: (temperature, top_p, seed) to sample instead, top-k off as ours, torch seeded first.
    """
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False)
    if sampling is not None:
        temperature, top_p, seed = sampling
        kwargs.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
        torch.manual_seed(seed)
    if fixed_length:
        kwargs["min_new_tokens"] = max_new_tokens
    if assistant is not None:
        kwargs["assistant_model"] = assistant
    if prompt_lookup is not None:
        kwargs["prompt_lookup_num_tokens"] = prompt_lookup
    with torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(torch.tensor([prompt_ids]), **kwargs)
        seconds = time.perf_counter() - start
    ids = out[0, len(prompt_ids):].tolist()
    return PromptRun(ids, seconds, {"new_tokens": len(ids), "tokens_per_s": len(ids) / seconds})


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two outputs differ (None when identical)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def aggregate(runs: list[PromptRun]) -> dict:
    """Totals over prompts: tokens/s over the whole run and over its decoding alone (prefill left
    out), the prefill seconds, tau, acceptance by position."""
    tokens = sum(len(r.output_ids) for r in runs)
    seconds = sum(r.seconds for r in runs)
    out = {"new_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / max(seconds, 1e-9)}
    if runs and all("prefill_s" in r.stats for r in runs):  # ours (peers time the whole call only)
        prefill = sum(r.stats["prefill_s"] for r in runs)
        out["prefill_s"] = prefill
        out["decode_tokens_per_s"] = tokens / max(seconds - prefill, 1e-9)  # the prompts' prefill left out
    moved = mb_per_token(runs)  # under --expert-budget: the decode's expert traffic (bench/expert_budget.py)
    if moved is not None:
        out["expert_mb_per_token"] = moved
        out["expert_misses"] = sum(r.stats["expert_misses"] for r in runs)
        out["expert_stall_s"] = sum(r.stats["expert_stall_s"] for r in runs)
    if runs and "rounds" in runs[0].stats:
        rounds = sum(r.stats["rounds"] for r in runs)
        committed = sum(r.stats["committed"] for r in runs)
        depth = max(len(r.stats["acceptance_by_position"]) for r in runs)
        hist_len = max(len(r.stats["accepted_length_hist"]) for r in runs)
        hist = [sum(r.stats["accepted_length_hist"][i] for r in runs if i < len(r.stats["accepted_length_hist"]))
                for i in range(hist_len)]
        accepted = [0] * depth
        proposed = [0] * depth
        for r in runs:
            for i, (a, p) in enumerate(zip(r.stats["accepted_by_position"], r.stats["proposed_by_position"])):
                accepted[i] += a
                proposed[i] += p
        out.update({
            "rounds": rounds,
            "mean_accepted_length": committed / max(rounds, 1),
            # accepted draft depths / drafted depths (on a chain: accepted drafts / drafted tokens)
            "acceptance_rate": sum(accepted) / sum(proposed) if sum(proposed) else None,
            "acceptance_by_position": [a / max(p, 1) for a, p in zip(accepted, proposed)],
            "accepted_length_hist": hist,
            "drafted": sum(r.stats.get("drafted", 0) for r in runs),  # draft nodes (bench/round_cost.py)
            "draft_s": sum(r.stats["draft_s"] for r in runs),
            "verify_s": sum(r.stats["verify_s"] for r in runs),
        })
    return out
