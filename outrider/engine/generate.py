"""Offline generation: a fixed list of requests through the engine loop, each to its end.

    engines = offline_engine(target, requests, eos_ids, speculation, decode)   # sized for them
    completions = generate_ids(target, requests, eos_ids, speculation=spec)    # all at once

Autoregressive decoding is the round with a root-only tree; a drafter makes the trees larger.
Every request is admitted at once, every prompt prefilled in one forward, and each slot holds
`max_len` rows (by default the longest prompt + max_new_tokens + one round's tree).
"""

from __future__ import annotations

from .loop import Decode, EngineLoop
from .request import Completion, Request, check_request


def offline_engine(target, requests: list[Request], eos_ids: set[int], speculation=None, decode: Decode | None = None,
                   max_len: int | None = None, prefix_cache=None, kv_pages: int | None = None) -> EngineLoop:
    """An engine with a slot for every request and rows for the longest; ConfigError for a
    request that cannot fit the target's context. prefix_cache: an engine.prefix_cache.PrefixCache
    kept across calls (LLM's), or None; kv_pages: the K/V in a pool of that many pages
    (engine/paging.py: requests run as their pages allow), or None."""
    headroom = speculation.max_tree_size if speculation is not None else 1
    longest = max(len(r.prompt_ids) + r.max_new_tokens for r in requests)
    max_len = max_len or min(target.config.max_position_embeddings, longest + headroom)
    for i, r in enumerate(requests):
        check_request(r, max_len, f"prompt {i}", "pass a larger max_len")
    return EngineLoop(target, eos_ids, speculation, decode=decode, max_running=len(requests), max_len=max_len,
                      prefix_cache=prefix_cache, kv_pages=kv_pages)


def generate_ids(target, requests: list[Request], eos_ids: set[int], *, max_len: int | None = None,
                 speculation=None, decode: Decode | None = None) -> list[Completion]:
    """Generate for every request at once, one slot each; Completions in request order.
    `speculation` (an engine.speculator.Speculator) drafts; without it every round is one
    autoregressive step. Without `decode` the Completions have no text (and no stop strings)."""
    engine = offline_engine(target, requests, eos_ids, speculation, decode, max_len)
    return engine.run_all(requests)
