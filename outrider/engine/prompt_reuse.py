"""A prompt's K/V reused instead of prefilled, the two ways the engine loop (engine/loop.py) does it:

    restore(prefix_cache, state, seq, taps)   # rows of the prompt's longest cached prefix of whole
                                              # blocks copied into seq's slot (engine/prefix_cache.py)
    share_first(prefix_cache, state, seq, slot, taps)  # paged: those pages shared at admission
    store(prefix_cache, state, seq, rows)     # the slot's first `rows` rows kept in the prefix cache
    copy_from(state, source, seq, taps)       # the whole prompt copied from a running request that
                                              # holds the same prompt (Request.prefill_from)

Each one refuses, and the prompt is prefilled as usual, where reused rows could not be what a
prefill computes for this request: prompt logprobs or a drafter that reads the prompt's hidden
states (every row must be computed), image rows (the tokens do not say the K/V), a request whose
rows came from a lossy routing (`seq.cacheable` false), a recurrent state that holds only its
whole prefix (`state.can_copy_prefix`).
"""

from __future__ import annotations

from .sequence import Sequence


def _refused(prefix_cache, seq: Sequence, taps) -> bool:
    return (prefix_cache is None or seq.request.prompt_logprobs is not None or (taps and seq.speculate)
            or seq.request.prompt_embeds is not None)


def restore(prefix_cache, state, seq: Sequence, taps) -> None:
    """Copy the K/V of the prompt's longest cached prefix into the slot; seq.prefilled and
    seq.cached_tokens say how many rows came from the cache (none when refused)."""
    seq.looked_up = True
    if _refused(prefix_cache, seq, taps):
        return
    n = prefix_cache.restore(state, seq.slot, seq.tokens[: seq.prompt_len - 1])
    prefix_cache.record(seq.prompt_len, n)
    seq.prefilled = seq.cached_tokens = n
    state.set_length(seq.slot, n)


def share_first(prefix_cache, state, seq: Sequence, slot: int, taps) -> None:
    """At admission over paged K/V, before the slot takes its pages (engine/paging.py take_pages):
    the pages the cache holds for the prompt's prefix put in `slot` by reference, so that taking the
    rest cannot reclaim them. `restore` then finds them there (sharing a page twice changes nothing)
    and counts the hit. Nothing where restore would refuse, or the cache copies blocks."""
    if seq.looked_up or _refused(prefix_cache, seq, taps) or not prefix_cache.shares(state):
        return
    prefix_cache.restore(state, slot, seq.tokens[: seq.prompt_len - 1])


def store(prefix_cache, state, seq: Sequence, rows: int) -> None:
    """Keep the slot's first `rows` rows (the K/V of seq.tokens[:rows]) in the prefix cache."""
    if (prefix_cache is not None and seq.cacheable and seq.request.prompt_logprobs is None
            and seq.request.prompt_embeds is None):
        prefix_cache.store(state, seq.slot, seq.tokens[:rows])


def copy_from(state, source: Sequence | None, seq: Sequence, taps) -> bool:
    """Copy the prompt's K/V from `source` (the request named by seq's prefill_from) when it is
    decoding with the same prompt wholly in the state; whether it did."""
    if (source is None or source.slot < 0 or not source.decoding or (taps and seq.speculate)
            or source.request.prompt_embeds is not seq.request.prompt_embeds
            or source.tokens[: source.prompt_len] != seq.tokens[: seq.prompt_len]):
        return False
    n = seq.prompt_len - 1
    if not state.can_copy_prefix(source.slot, n):  # a recurrent state holds only its whole prefix
        return False
    state.copy_rows(source.slot, seq.slot, n)
    seq.prefilled = n
    state.set_length(seq.slot, n)
    return True
