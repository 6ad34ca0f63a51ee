"""The prefix cache over paged K/V with blocks of a page (engine/prefix_cache.py): blocks are the
pool's pages held by reference (no copy in or out), a request writing into a shared page copies it
first, a page is free when its last holder drops it, the pages only the cache holds go back when
the pool runs short, and engines over pages give the answers and cached tokens of a slot engine."""

from __future__ import annotations

import pytest
import torch

from outrider.engine.loop import EngineLoop
from outrider.engine.prefix_cache import PrefixCache
from outrider.models.paged_cache import OutOfPages, PagedKVCache
from test_prefix_cache import TURNS, chat

P = 4  # rows a page, tokens a block


def _pool(pages: int = 12) -> PagedKVCache:
    cache = PagedKVCache(2, 3, 64, 1, 4, torch.float32, "cpu", pages, P)
    for t in (*cache.k, *cache.v):
        t.copy_(torch.randn(t.shape))
    return cache


def _rows(cache: PagedKVCache, slot: int, n: int) -> list[torch.Tensor]:
    return [cache.slot_rows(t, slot, 0, n) for t in (*cache.k, *cache.v)]


def test_blocks_are_pages_shared_by_reference_copied_on_write_and_freed_by_the_last_holder():
    pool = _pool()
    pool.reserve(0, 14)  # 4 pages
    tokens = list(range(10, 24))
    cache = PrefixCache(block=P, budget_bytes=1 << 20)
    assert cache.store(pool, 0, tokens[:12]) == 3
    own = pool.held[0][:3]
    assert cache.pool is None and sorted(b.row for b in cache._lru.values()) == own  # the slot's pages, not copies
    assert all(pool.refs[p] == 2 for p in own) and pool.pages_used == 4
    before = _rows(pool, 0, 12)
    pool.reserve(1, 10)  # admitted: pages for its prompt
    assert cache.restore(pool, 1, tokens[:8] + [99, 98]) == 8
    assert pool.held[1][:2] == own[:2] and all(pool.refs[p] == 3 for p in own[:2])
    assert pool.pages_used == 5  # its two reserved pages given back for the shared ones, one kept
    assert all(torch.equal(a, b[:, :8]) for a, b in zip(_rows(pool, 1, 8), before))
    # copy on write: slot 1 writes row 5 (in the second shared page); slot 0 and the cache see no change
    new = torch.full((1, 1, 1, 4), 7.0)
    for layer in range(2):
        pool.write(layer, torch.tensor([1]), torch.tensor([[5]]), new, new)
    assert pool.held[1][1] not in own and pool.refs[own[1]] == 2
    assert all(torch.equal(a, b) for a, b in zip(_rows(pool, 0, 12), before))
    assert all(torch.equal(a, b) for a, b in zip(_rows(pool, 1, 4), [t[:, :4] for t in before]))
    assert torch.equal(pool.slot_rows(pool.k[0], 1, 5, 1), new[0].transpose(0, 1))
    # freed by the last holder: the slots end, the cache still holds its three pages
    pool.set_length(0, 0)
    pool.set_length(1, 0)
    assert pool.pages_used == 3 and all(pool.refs[p] == 1 for p in own)
    assert cache.restore(pool, 2, tokens) == 12 and all(pool.refs[p] == 2 for p in own)
    pool.set_length(2, 0)
    # the pool runs short: pages only the cache holds go back, least recent (the deepest) first
    pool.reserve(0, 11 * P)
    assert pool.free_pages == 0 and cache.blocks == 1 and pool.refs[own[0]] == 1
    assert cache.restore(pool, 1, tokens) == 4
    with pytest.raises(OutOfPages):  # the last block is held by slot 1 too: not reclaimed
        pool.reserve(0, 12 * P)
    assert cache.blocks == 1
    pool.set_length(1, 0)
    pool.reserve(0, 12 * P)
    assert cache.blocks == 0 and pool.free_pages == 0


def test_a_full_cache_evicts_a_block_a_slot_still_reads_without_freeing_its_page():
    pool = _pool()
    page_bytes = pool.page_bytes()
    cache = PrefixCache(block=P, budget_bytes=2 * page_bytes)  # two blocks
    pool.reserve(0, 12)
    assert cache.store(pool, 0, list(range(12))) == 2 and cache.capacity == 2
    first = pool.held[0][0]
    pool.reserve(1, 4)
    assert cache.store(pool, 1, [50, 51, 52, 53]) == 1  # the leaf of the first chain goes
    assert cache.blocks == 2 and pool.refs[pool.held[0][1]] == 1  # slot 0 holds it still: not free
    pool.set_length(0, 0)
    assert pool.refs[first] == 1 and pool.free_pages == 12 - 2


@pytest.fixture(scope="module")
def q4(tmp_path_factory):
    from outrider.weights.loader import load_decoder
    from test_native_layer import make_family

    return load_decoder(make_family("qwen2", tmp_path_factory.mktemp("prefix-pages") / "qwen2"), "cpu", "q4")


def test_multi_turn_chats_over_shared_pages_give_the_slot_engines_answers_and_cached_tokens(q4, runtime):
    """The native layer (its prefill the same bits in any chunks): a slot engine with a cache of its
    own and an engine whose cache shares pages give the same answers and cached tokens, which equal
    the answers without any cache; in a pool too small for the cache and a request, the cache's pages
    go back and the answers stay."""
    runtime(amx_prefill=False, gemm_prefill="off")
    plain, _ = chat(EngineLoop(q4, set(), None, max_running=4, max_len=200), TURNS)
    _, on_slots = chat(EngineLoop(q4, set(), None, max_running=4, max_len=200, prefix_cache=PrefixCache(block=P)),
                       TURNS)
    for pages in (40, 19):  # 19: the third turn (63 prompt rows, 16 pages + a round) needs the cache's pages
        cache = PrefixCache(block=P)
        engine = EngineLoop(q4, set(), None, max_running=4, max_len=200, chunk_size=5, prefix_cache=cache,
                            kv_pages=pages, page_size=P)
        answers, cached = chat(engine, TURNS)
        assert answers == plain and cached == on_slots and cached[1] > 0
        assert cache.pool is None and engine.cache.pages_used == cache.blocks > 0  # only the cache's pages left
        assert all(engine.cache.refs[b.row] == 1 for b in cache._lru.values())


def test_a_round_short_of_pages_takes_the_caches_before_preempting(q4, runtime):
    """A long prompt leaves most of the pool to the cache; two requests then decode side by side and
    their rounds take the cache's pages back instead of preempting one of them."""
    from outrider.engine.generate import generate_ids
    from outrider.engine.request import Request

    runtime(amx_prefill=False, gemm_prefill="off")
    engine = EngineLoop(q4, set(), None, max_running=4, max_len=200, prefix_cache=PrefixCache(block=P),
                        kv_pages=16, page_size=P)
    engine.run_all([Request(list(range(10, 51)), 1)])
    assert engine.prefix_cache.blocks == 10 and engine.cache.free_pages == 6
    requests = [Request([5, 9, 14, 3, 22, 7, 31, 8, 40], 14), Request([8, 40, 11, 6, 19, 27, 4], 14)]
    outs = engine.run_all(requests)
    assert [o.token_ids for o in outs] == [generate_ids(q4, [r], set())[0].token_ids for r in requests]
    assert engine.preemptions == 0 and len(engine.prefix_cache._match(list(range(10, 51)))) < 10  # taken back


def test_llm_generate_keeps_shared_pages_across_calls(tmp_path, runtime):
    """LLM.generate makes an engine (and a pool) a call: the cache's blocks move into the new pool."""
    from outrider.llm import LLM
    from test_native_layer import make_family
    from test_prefix_cache import SYSTEM
    from tiny import add_tokenizer

    runtime(amx_prefill=False, gemm_prefill="off")
    folder = add_tokenizer(make_family("llama", tmp_path / "llama"))
    prompt = " ".join(f"w{t}" for t in SYSTEM + [60, 61, 62])
    on = LLM(str(folder), device="cpu", dtype="q4", kv_memory="40p")
    off = LLM(str(folder), device="cpu", dtype="q4", prefix_cache_mb=0)
    first = on.generate(prompt, 10)
    again = on.generate([prompt, prompt + " w7 w8"], 10)
    assert on.prefix_cache_note is None and first.cached_tokens == 0
    assert [c.cached_tokens for c in again] == [16, 16] and on.prefix_cache.pool is None
    assert [c.text for c in again] == [c.text for c in off.generate([prompt, prompt + " w7 w8"], 10)]
