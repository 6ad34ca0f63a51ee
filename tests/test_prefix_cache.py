"""The exact prefix cache (engine/prefix_cache.py): blocks keyed by their whole prefix, LRU
eviction under a budget, and prompts whose prefix comes from the cache giving the bits of a whole
prefill, so that greedy output with the cache equals output without it (multi-turn chats, a
shared system prompt, speculation with the suffix drafter, a draft model and early exit)."""

from __future__ import annotations

import pytest
import torch

from outrider.control.controllers import FixedController
from outrider.drafters.model import ModelDrafter
from outrider.drafters.suffix import SuffixDrafter
from outrider.engine.loop import EngineLoop
from outrider.engine.prefix_cache import PrefixCache
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.models.kv_cache import KVCache
from outrider.spec.shapes import parse_shape
from outrider.weights.loader import load_decoder
from test_native_layer import make_family

P = 8  # tokens a block in these tests
SYSTEM = [5, 9, 14, 3, 22, 7, 31, 8, 40, 11, 6, 19, 27, 4, 33, 12, 9, 50, 21, 17]  # 20 tokens: 2 whole blocks


# -- the pool on its own ---------------------------------------------------------------------------
def _state(rows: int = 64) -> KVCache:
    state = KVCache(2, 2, rows, 1, 4, torch.float32, "cpu")
    for t in (*state.k, *state.v):
        t.copy_(torch.randn(t.shape))
    return state


def test_a_block_is_found_only_after_the_prefix_it_was_computed_after():
    state = _state()
    cache = PrefixCache(block=4, budget_bytes=1 << 20)
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert cache.store(state, 0, a) == 2  # two whole blocks; the ninth token is not kept
    other = _state()
    assert cache.restore(other, 1, [9, 9, 9, 9, 5, 6, 7, 8]) == 0  # block 2's tokens after another block 1
    assert cache.restore(other, 1, [1, 2, 3, 4, 5, 6, 0, 8]) == 4
    assert cache.restore(other, 1, a + [1, 2, 3]) == 8
    for own, kept in zip((*other.k, *other.v), (*state.k, *state.v)):
        assert torch.equal(own[1, :, :8], kept[0, :, :8])
        assert not torch.equal(own[1, :, 8:12], kept[0, :, 8:12])  # nothing past the match is written
    assert cache.store(state, 0, a) == 0  # already held


def test_the_least_recently_used_block_goes_and_takes_the_blocks_after_it():
    state = _state()
    per_block = 4 * 4 * 4 * 4  # P x width x float32 x (2 layers x K and V)
    cache = PrefixCache(block=4, budget_bytes=3 * per_block)
    assert cache.capacity == 0 and cache.store(state, 0, [1] * 8) == 2 and cache.capacity == 3
    assert cache.store(state, 0, [2] * 4) == 1  # full now
    assert cache.restore(state, 1, [1] * 8) == 8  # [1]*8 used after [2]*4
    assert cache.store(state, 0, [3] * 4) == 1  # evicts [2]*4, the least recent
    assert cache.restore(state, 1, [2] * 4) == 0 and cache.restore(state, 1, [1] * 8) == 8
    assert cache.store(state, 0, [4] * 8) == 2  # evicts [3]*4 then the leaf of [1]*8 ...
    assert cache.restore(state, 1, [1] * 8) == 4  # ... whose first block, more recent, stays
    assert cache.blocks == 3 and cache.usage() == 1.0


def test_a_held_block_is_not_evicted():
    state = _state()
    cache = PrefixCache(block=4, budget_bytes=4 * 4 * 4 * 4)  # one block
    assert cache.store(state, 0, [1] * 4) == 1
    blocks = cache._match([1] * 4)
    cache._hold(blocks, 1)
    assert cache.store(state, 0, [2] * 4) == 0  # no room: the only block is held
    cache._hold(blocks, -1)
    assert cache.store(state, 0, [2] * 4) == 1


# -- the engine --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_family("qwen2", tmp_path_factory.mktemp("prefix") / "qwen2")


@pytest.fixture
def target(folder, runtime):
    runtime(amx_prefill=False, gemm_prefill="off")  # the native layer's prefill: the same bits in any chunks
    return load_decoder(folder, "cpu", "q4")


def engine(target, cache=None, spec=None, chunk=None):
    return EngineLoop(target, set(), spec, max_running=4, max_len=200, chunk_size=chunk, prefix_cache=cache)


def chat(eng, turns: list[list[int]], n: int = 12) -> tuple[list[list[int]], list[int]]:
    """Turns of one conversation: each prompt is the history (earlier prompts and answers) and the
    turn's message; the answers and each turn's cached tokens."""
    history, answers, cached = [], [], []
    for message in turns:
        prompt = history + message
        done = eng.run_all([Request(prompt, n)])[0]
        answers.append(done.token_ids)
        cached.append(done.cached_tokens)
        history = prompt + done.token_ids
    return answers, cached


TURNS = [SYSTEM + [60, 61, 62, 63, 64], [70, 71, 72], [80, 81, 82, 83, 84, 85, 86, 87, 88, 89, 90]]


def test_a_repeated_prompt_restores_its_prefix_with_the_bits_of_a_whole_prefill(target, monkeypatch):
    cache = PrefixCache(block=P)
    eng = engine(target, cache)
    assert eng.prefix_cache is cache, eng.prefix_cache_note
    prompt = SYSTEM + [60, 61, 62, 63, 64, 65]  # 26 tokens: 25 prefilled, 3 whole blocks
    first = eng.run_all([Request(prompt, 14)])[0]  # 40 tokens, 39 rows at the end: 4 whole blocks kept
    assert first.cached_tokens == 0
    # the second: 24 rows from the cache, one prefilled; its rows equal a whole prefill's
    rows = []
    forward = target.forward
    monkeypatch.setattr(target, "forward", lambda b, c, **k: rows.append(b.tokens.shape[1]) or forward(b, c, **k))
    again = eng.run_all([Request(prompt, 14)])[0]
    assert again.cached_tokens == 24 and rows[0] == 1
    assert again.token_ids == first.token_ids
    assert cache.queries == 2 * len(prompt) and cache.hits == 24
    whole = engine(target)
    whole.run_all([Request(prompt, 14)])
    for own, ref in zip((*eng.cache.k, *eng.cache.v), (*whole.cache.k, *whole.cache.v)):
        assert torch.equal(own[0, :, :39], ref[0, :, :39])  # prompt and output rows, bit for bit
    # the last token's row was never written (it is the root of a round that did not run): not kept
    longer = prompt + first.token_ids + [70, 71]
    assert eng.run_all([Request(longer, 4)])[0].cached_tokens == 32


def test_multi_turn_chat_and_a_shared_system_prompt_give_the_output_without_the_cache(target):
    plain, none = chat(engine(target), TURNS)
    cache = PrefixCache(block=P)
    answers, cached = chat(engine(target, cache, chunk=5), TURNS)  # small chunks: the rest in several steps
    assert answers == plain and none == [0, 0, 0]
    # turn 2: turn 1's prompt and answer, 37 tokens, kept to 36 rows at its end: 4 blocks; turn 3: 51 rows, 6
    assert cached == [0, 32, 48]
    other = [SYSTEM + [90, 91, 92, 93]]  # another user, the same system prompt
    alone, _ = chat(engine(target), other)
    shared, hit = chat(engine(target, cache), other)
    assert shared == alone and hit == [16]


def _spec(drafter, shape="chain"):
    return Speculator(SpecOptions(drafter.name, shape, "fixed:4"), drafter, FixedController(4), parse_shape(shape))


@pytest.mark.parametrize("kind", ["suffix", "draft-model", "early-exit"])
def test_speculation_with_the_cache_gives_the_plain_output(target, folder, kind):
    def make():
        if kind == "suffix":
            return _spec(SuffixDrafter())
        if kind == "draft-model":
            draft = load_decoder(make_family("qwen2", folder.parent / "draft", seed=3), "cpu", "q4")
            return _spec(ModelDrafter(draft, parse_shape("static:2,1,1"), name="draft-model:tiny"), "static:2,1,1")
        return _spec(ModelDrafter(target, parse_shape("chain"), num_layers=1, name="early-exit:1",
                                  share_target_cache=True))

    plain, _ = chat(engine(target), TURNS)
    answers, cached = chat(engine(target, PrefixCache(block=P), make()), TURNS)
    assert answers == plain and cached == [0, 32, 48]


def test_the_cache_is_off_where_a_prefill_is_not_the_same_bits_chunked(folder, runtime):
    runtime(amx_prefill=False, gemm_prefill="on")  # Intel's float GEMM from 96 rows
    eng = engine(load_decoder(folder, "cpu", "q4"), PrefixCache(block=P))
    assert eng.prefix_cache is None and "gemm_prefill=off" in eng.prefix_cache_note
    runtime(gemm_prefill="off")
    eng = engine(load_decoder(folder, "cpu"), PrefixCache(block=P))  # float32: the torch layers
    assert eng.prefix_cache is None and "torch layers" in eng.prefix_cache_note
    from outrider.engine.prefix_cache import why_not_exact
    from outrider.models.state import HybridState

    assert "HybridState" in why_not_exact(None, HybridState.__new__(HybridState))  # recurrent layers: off
    from outrider.cluster.pipeline import PipelineState

    why = why_not_exact(None, PipelineState.__new__(PipelineState))  # the stages hold the K/V: says so
    assert "pipeline's stages" in why and "gated-delta" not in why


def test_llm_generate_keeps_the_cache_across_calls(folder, runtime):
    from outrider.llm import LLM
    from tiny import add_tokenizer

    runtime(amx_prefill=False, gemm_prefill="off")
    folder = add_tokenizer(make_family("llama", folder.parent / "llama"))  # a word-level tokenizer
    prompt = " ".join(f"w{t}" for t in SYSTEM + [60, 61, 62])
    on, off = LLM(str(folder), device="cpu", dtype="q4"), LLM(str(folder), device="cpu", dtype="q4", prefix_cache_mb=0)
    first = on.generate(prompt, 10)
    again = on.generate([prompt, prompt + " w7 w8"], 10)
    assert on.prefix_cache_note is None and first.cached_tokens == 0
    assert [c.cached_tokens for c in again] == [16, 16]  # 22 rows of prompt: 1 block of 16; the output past it
    assert [c.text for c in again] == [c.text for c in off.generate([prompt, prompt + " w7 w8"], 10)]
    assert off.prefix_cache is None
