"""Admission and preemption by K/V pages (a paged cache: models/paged_cache.py).

With a paged cache a running request holds only the pages its rows reach, so the engine admits a
request when the pages for its prompt and one round are free (it waits otherwise, first come first
served as always), and before each round takes the pages every decoding request's round may write.
When the pool cannot give them, the request admitted last is preempted: its pages go back, it
returns to the head of the queue with its committed tokens, and when it is admitted again its
prompt and output so far are prefilled as one prompt (recompute, as vLLM does) and it goes on
from there. Pages only the prefix cache holds are given back before a request waits or is preempted
(PagedKVCache.reclaim). What it commits never depends on that: its randomness is drawn by output position and
its drafter restarts from the committed tokens, so greedy output is unchanged (tests/test_paging.py).
"""

from __future__ import annotations

import re

import torch

from ..errors import ConfigError
from ..models.paged_cache import OutOfPages
from .prompt_reuse import share_first


def page_bytes(target, page_size: int) -> int:
    """Bytes one page of `page_size` rows takes in `target`'s cache, every layer's K and V."""
    c = target.config
    size = torch.empty((), dtype=target.kv_dtype or target.dtype).element_size()
    return 2 * c.num_layers * c.num_kv_heads * page_size * c.head_dim * size


def parse_kv_memory(text) -> tuple[str, int]:
    """--kv-memory's value: ("mib", N) or ("pages", N); ConfigError naming the flag otherwise."""
    m = re.fullmatch(r"\s*(\d+)\s*(mib|mb|m|pages|page|p)?\s*", str(text).lower())
    if m is None or int(m.group(1)) < 1 or isinstance(text, bool):
        raise ConfigError(f"--kv-memory must be a positive number of MiB (512, 512MiB) or pages (2000p), got {text!r}")
    return ("pages" if m.group(2) and m.group(2).startswith("p") else "mib"), int(m.group(1))


def pages_of(text, target, page_size: int) -> int:
    """The pool's pages for --kv-memory `text` in `target` (MiB: as many whole pages as fit)."""
    unit, n = parse_kv_memory(text)
    if unit == "pages":
        return n
    pages = (n << 20) // page_bytes(target, page_size)
    if pages < 1:
        raise ConfigError(f"--kv-memory {text}: one page of {page_size} rows takes "
                          f"{page_bytes(target, page_size) / (1 << 20):.2f} MiB in this model; give more")
    return pages


def fill_rows(seq) -> int:
    """Rows whose K/V a request writes before its first round: its prompt, or after a preemption its
    prompt and output, but the last token (the round's root)."""
    return (seq.resume_at or seq.prompt_len) - 1


def round_rows(seq, headroom: int) -> int:
    """Rows a request may write by the end of its next round: its length and one draft tree."""
    return len(seq.tokens) - 1 + (headroom if seq.speculate else 1)


def take_pages(cache, seq, slot: int, headroom: int, prefix_cache=None, taps=()) -> bool:
    """The scheduler's question at admission: whether `slot` can hold the pages of `seq`'s prefill and
    first round; when it can, the slot is emptied and takes them. The prefix cache's pages for its
    prompt are shared into the slot first (prompt_reuse.share_first), so that the pages reclaimed
    from the cache to make room are never the ones it is about to read."""
    cache.set_length(slot, 0)
    if prefix_cache is not None:
        share_first(prefix_cache, cache, seq, slot, taps)
    try:
        cache.reserve(slot, fill_rows(seq) + (headroom if seq.speculate else 1))
    except OutOfPages:  # it takes nothing then: the request waits
        cache.set_length(slot, 0)
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
        if need <= cache.make_free(need) or len(live) <= 1:  # the prefix cache's own pages go first
            break
        victim = live.pop()
        victims.append(victim)
        cache.set_length(victim.slot, 0)  # its pages, free for the others now
    for seq in decoding:
        if seq in live:
            cache.reserve(seq.slot, round_rows(seq, headroom))
    return victims
