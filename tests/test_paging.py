"""Admission and preemption by K/V pages (engine/paging.py) with a paged cache: a request waits
for pages, one that runs out mid-decode is preempted and re-queued, and every output equals the
request's output alone on a slot cache: plain, prompt logprobs, and greedy speculation with the
suffix drafter and a draft model."""

from __future__ import annotations

import pytest
import torch

from enumerate_law import one_thread

from outrider.control.controllers import FixedController
from outrider.drafters.model import ModelDrafter
from outrider.drafters.suffix import SuffixDrafter
from outrider.engine.generate import generate_ids
from outrider.engine.loop import EngineLoop
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.errors import ConfigError
from outrider.spec.shapes import parse_shape
from outrider.weights.loader import load_decoder

P = 4  # rows a page


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def target(tiny_folders):
    return load_decoder(tiny_folders["llama"], "cpu")


PROMPTS = [[5, 9, 14, 3, 22, 7, 31], [8, 40, 11, 6, 19], [27, 4, 33, 12, 9, 50, 21, 17, 30], [44, 45, 46]]


def _spec(drafter, shape="chain"):
    return Speculator(SpecOptions(drafter.name, shape, "fixed:3"), drafter, FixedController(3), parse_shape(shape))


def _requests(n=14):
    return [Request(list(p), n) for p in PROMPTS]


def alone(target) -> list[list[int]]:
    return [generate_ids(target, [r], set())[0].token_ids for r in _requests()]


def paged(target, pages, spec=None, chunk=None):
    return EngineLoop(target, set(), spec, max_running=4, max_len=64, chunk_size=chunk, kv_pages=pages, page_size=P)


def _run(engine, requests):
    """Run to the end, recording how many ran at once each step; the completions in order."""
    ids = [engine.add(r) for r in requests]
    done, running = {}, []
    while engine.has_work:
        for event in engine.step():
            if event.completion is not None:
                done[event.request_id] = event.completion
        running.append(engine.num_running)
        assert engine.cache.pages_used <= engine.cache.num_pages
    return [done[i] for i in ids], running


def test_plenty_of_pages_run_everything_at_once_and_give_the_outputs_alone(target):
    engine = paged(target, 64)
    outs, running = _run(engine, _requests())
    assert [o.token_ids for o in outs] == alone(target)
    assert max(running) == 4 and engine.preemptions == 0
    assert engine.cache.pages_used == 0  # every page back at the end


def test_a_short_pool_preempts_and_requeues_with_the_outputs_unchanged(target, monkeypatch):
    engine = paged(target, 12, chunk=5)  # 48 rows for four requests reaching 10-23 rows each
    preempted, preempt = [], engine._preempt
    monkeypatch.setattr(engine, "_preempt", lambda seq: preempted.append(seq.seq_id) or preempt(seq))
    outs, running = _run(engine, _requests())
    assert [o.token_ids for o in outs] == alone(target)
    assert engine.preemptions == len(preempted) > 0 and max(running) >= 2
    assert 0 not in preempted  # the last admitted goes first: the oldest request is never preempted
    assert engine.cache.pages_used == 0


def test_a_request_waits_until_its_prompt_pages_are_free(target):
    engine = paged(target, 6)  # 24 rows: the 9-token prompt and its round (10 rows) after the first
    first = engine.add(Request(list(PROMPTS[2]), 6))
    engine.step()
    engine.add(Request(list(PROMPTS[2]), 6))
    engine.add(Request([7] * 12, 6))  # 12 rows + a round: 4 pages, not free while the two run
    engine.step()
    assert (engine.num_running, engine.num_waiting) == (2, 1)
    assert engine.cache.free_pages < 4
    while engine.num_waiting:
        engine.step()
    assert first not in engine._seqs  # the third got in when the first finished and gave its pages back
    with pytest.raises(ConfigError, match="needs 9 K/V pages but the pool holds 6"):
        engine.add(Request([3] * 30, 4))


def test_prompt_logprobs_are_given_once_through_a_preemption(target):
    requests = _requests(10)
    requests[3] = Request(list(PROMPTS[3]), 10, prompt_logprobs=1)
    engine = paged(target, 10)
    outs, _ = _run(engine, requests)
    assert engine.preemptions > 0
    assert len(outs[3].prompt_logprobs) == len(PROMPTS[3])
    ref = generate_ids(target, [Request(list(PROMPTS[3]), 10, prompt_logprobs=1)], set())[0]
    assert outs[3].prompt_logprobs == ref.prompt_logprobs and outs[3].token_ids == ref.token_ids


@pytest.mark.parametrize("kind", ["suffix", "draft-model"])
def test_greedy_speculation_with_pages_and_preemption_equals_plain(target, tiny_folders, kind):
    def make():
        if kind == "suffix":
            return _spec(SuffixDrafter())
        draft = load_decoder(tiny_folders["llama-draft"], "cpu")
        return _spec(ModelDrafter(draft, parse_shape("static:2,1,1"), name="draft-model:tiny"), "static:2,1,1")

    engine = paged(target, 14, make())
    outs, _ = _run(engine, _requests())
    assert [o.token_ids for o in outs] == alone(target)
    assert engine.preemptions > 0


def test_a_drafter_reading_the_target_cache_is_refused_with_pages(target):
    early = _spec(ModelDrafter(target, parse_shape("chain"), num_layers=1, name="early-exit:1",
                               share_target_cache=True))
    with pytest.raises(ConfigError, match="reads the target's slot cache"):
        paged(target, 16, early)


@pytest.fixture(scope="module")
def q4(tmp_path_factory):
    """A q4 model: the native decoder layer runs it (over pages: models/paged_cache.py SlotCopy)."""
    from test_native_layer import make_family

    return load_decoder(make_family("qwen2", tmp_path_factory.mktemp("paged-q4") / "qwen2"), "cpu", "q4")


def test_greedy_speculation_on_the_native_layer_over_pages_equals_plain(q4):
    engine = paged(q4, 14, _spec(SuffixDrafter()))
    outs, _ = _run(engine, _requests())
    assert [o.token_ids for o in outs] == alone(q4) and engine.preemptions > 0


def test_the_prefix_cache_restores_into_pages_with_the_plain_answers(q4, runtime):
    """A q4 model (the native layer, whose prefill is the same bits in any chunks): the prefix cache
    keeps blocks read out of pages and copies them into a new request's pages; multi-turn chats
    give the answers of a slot engine without the cache, with the same cached tokens as on slots."""
    from outrider.engine.prefix_cache import PrefixCache
    from test_prefix_cache import TURNS, chat

    runtime(amx_prefill=False, gemm_prefill="off")
    plain, _ = chat(EngineLoop(q4, set(), None, max_running=4, max_len=200), TURNS)
    cache = PrefixCache(block=8)
    engine = EngineLoop(q4, set(), None, max_running=4, max_len=200, chunk_size=5, prefix_cache=cache,
                        kv_pages=40, page_size=P)
    assert engine.prefix_cache is cache, engine.prefix_cache_note
    answers, cached = chat(engine, TURNS)
    assert answers == plain and cached == [0, 32, 48] and engine.cache.pages_used == 0
    # a repeated first turn: its restored and prefilled rows, read out of the pages, are a whole prefill's bits
    from outrider.engine.request import Request as R

    n = len(TURNS[0]) - 1
    rows = []
    for eng in (engine, EngineLoop(q4, set(), None, max_running=4, max_len=200)):
        rid = eng.add(R(list(TURNS[0]), 4))
        while not eng._seqs[rid].decoding:
            eng.step()
        if eng is engine:
            assert eng._seqs[rid].cached_tokens == 24  # 25 prompt rows: 3 whole blocks from the cache
            rows.append([eng.cache.slot_rows(t, 0, 0, n) for t in (*eng.cache.k, *eng.cache.v)])
        else:
            rows.append([t[0, :, :n] for t in (*eng.cache.k, *eng.cache.v)])
    assert all(torch.equal(a, b) for a, b in zip(*rows))
