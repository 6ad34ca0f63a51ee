"""Admission and preemption by K/V pages (a paged cache: models/paged_cache.py).

With a paged cache a running request holds only the pages its rows reach, so the engine admits a
request when the pages for its prompt and one round are free (it waits otherwise, first come first
served as always), and before each round takes the pages every decoding request's round may write.
When the pool cannot give them, the request admitted last is preempted: its pages go back, it
returns to the head of the queue with its committed tokens, and when it is admitted again its
prompt and output so far are prefilled as one prompt (recompute, as vLLM does) and it goes on
from there. What it commits never depends on that: its randomness is drawn by output position and
its drafter restarts from the committed tokens, so greedy output is unchanged (tests/test_paging.py).
"""

from __future__ import annotations

from ..models.paged_cache import OutOfPages


def fill_rows(seq) -> int:
    """Rows whose K/V a request writes before its first round: its prompt, or after a preemption its
    prompt and output, but the last token (the round's root)."""
    return (seq.resume_at or seq.prompt_len) - 1


def round_rows(seq, headroom: int) -> int:
    """Rows a request may write by the end of its next round: its length and one draft tree."""
    return len(seq.tokens) - 1 + (headroom if seq.speculate else 1)


def take_pages(cache, seq, slot: int, headroom: int) -> bool:
    """The scheduler's question at admission: whether `slot` can hold the pages of `seq`'s prefill and
    first round; when it can, the slot is emptied and takes them."""
    cache.set_length(slot, 0)
    try:
        cache.reserve(slot, fill_rows(seq) + (headroom if seq.speculate else 1))
    except OutOfPages:  # it takes nothing then: the request waits
        return False
    return True


def make_room(cache, running: list, decoding: list, headroom: int) -> list:
    """Take the pages each decoding request's round may write. While the pool cannot give them all,
    the request admitted last (of `running`, in admission order) is given up: returned, in the order
    they went, for the engine to preempt. What is left of `decoding` gets its pages."""
    victims = []
    live = list(running)
    while True:
        need = sum(cache.pages_needed(s.slot, round_rows(s, headroom)) for s in decoding if s in live)
        if need <= cache.free_pages or len(live) <= 1:
            break
        victim = live.pop()
        victims.append(victim)
        cache.set_length(victim.slot, 0)  # its pages, free for the others now
    for seq in decoding:
        if seq in live:
            cache.reserve(seq.slot, round_rows(seq, headroom))
    return victims
