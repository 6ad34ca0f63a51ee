"""The serving engine: requests that come and go commit exactly what each would commit alone."""

import pytest
import torch

from outrider.llm import LLM
from outrider.errors import ConfigError
from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.sampling import SamplingParams
from outrider.engine.loop import EngineLoop


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def llm(tiny_folders):
    return LLM(str(tiny_folders["llama"]), drafter="ngram", controller="fixed:3", device="cpu")


@pytest.fixture(scope="module")
def target(llm):
    return llm.target


@pytest.fixture(scope="module")
def ngram(llm):
    return llm.speculator


def prompt(i: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(100 + i)
    base = torch.randint(3, 96, (4,), generator=g).tolist()
    return (base * n)[:n]  # repeats: the n-gram drafter finds matches


def alone(target, request: Request) -> list[int]:
    return generate_ids(target, [request], set())[0].token_ids


def run(engine: EngineLoop, arrivals: dict[int, list[Request]], check=None):
    """Add arrivals[k] before step k; step until done. -> ({request id: Completion}, {id: first step})."""
    finished, first, ids, step = {}, {}, [], 0
    while engine.has_work or step in arrivals:
        ids += [engine.add(r) for r in arrivals.get(step, [])]
        for event in engine.step():
            if event.new_tokens:
                first.setdefault(event.request_id, step)
            if event.completion is not None:
                finished[event.request_id] = event.completion
        if check:
            check(engine)
        step += 1
    return [finished[i] for i in ids], [first.get(i) for i in ids]


def test_staggered_greedy_equals_each_alone_with_chunked_prefill(target, ngram):
    reqs = [Request(prompt(0, 9), 12), Request(prompt(1, 5), 10, speculate=False),
            Request(prompt(2, 40), 8),  # long: prefilled 8 tokens a step
            Request(prompt(3, 7), 12, max_draft_tokens=1), Request(prompt(4, 3), 9), Request(prompt(5, 12), 11)]
    engine = EngineLoop(target, set(), ngram, max_running=3, chunk_size=8)
    arrivals = {0: reqs[:2], 2: [reqs[2]], 3: [reqs[3]], 5: reqs[4:]}
    seen = []
    outs, first = run(engine, arrivals, lambda e: seen.append(e.num_running))
    assert max(seen) == 3 and min(seen[:-1]) >= 1
    for r, f in zip(reqs, outs):
        assert f.token_ids == alone(target, r)
    # the long prompt (39 rows to prefill, 8 a step) yields its first token at step 2 + 4 at the
    # earliest, while the two requests admitted before it keep decoding
    assert first[2] >= 6
    assert all(f.round_stats.rounds > 0 for f in outs)
    assert outs[1].round_stats.drafted == 0 and outs[0].round_stats.drafted > 0
    assert max(len(h) for h in [outs[3].round_stats.accepted_length_hist]) <= 2  # at most one draft a round


def test_seeded_sampling_equals_each_alone(target, ngram):
    reqs = [Request(prompt(i, 6 + i), 10, SamplingParams(temperature=0.9, top_p=0.95, seed=7 + i))
            for i in range(4)]
    engine = EngineLoop(target, set(), ngram, max_running=2)
    outs, _ = run(engine, {0: reqs[:1], 1: reqs[1:3], 4: reqs[3:]})
    for r, f in zip(reqs, outs):
        assert f.token_ids == alone(target, r)


def test_limits_make_requests_wait_never_drop(target):
    reqs = [Request(prompt(i, 5), 6) for i in range(5)]
    slots = EngineLoop(target, set(), max_running=2)
    seen = []
    outs, _ = run(slots, {0: reqs}, lambda e: seen.append((e.num_running, e.num_waiting)))
    assert max(r for r, _ in seen) == 2 and seen[0] == (2, 3)
    rows = EngineLoop(target, set(), max_running=4, max_kv_rows=14)  # each reserves 5 + 6 + 1 = 12
    seen = []
    outs2, _ = run(rows, {0: reqs}, lambda e: seen.append(e.num_running))
    assert max(seen) == 1
    for r, a, b in zip(reqs, outs, outs2):
        assert a.token_ids == b.token_ids == alone(target, r)
    with pytest.raises(ConfigError, match="K/V rows"):
        rows.add(Request(prompt(0, 5), 20))


def test_cancel_frees_the_slot_for_a_waiting_request(target):
    engine = EngineLoop(target, set(), max_running=1)
    a = engine.add(Request(prompt(0, 5), 50))
    b = engine.add(Request(prompt(1, 5), 4))
    engine.step()
    assert (engine.num_running, engine.num_waiting) == (1, 1)
    engine.cancel(a)
    events = {e.request_id: e for e in engine.step()}
    assert events[a].completion.finish_reason == "cancelled"
    assert events[b].new_tokens  # admitted into a's slot in the same step
    assert engine.scheduler.running[0].slot == 0


def test_bad_requests_are_refused_at_add(target):
    engine = EngineLoop(target, set(), max_running=1, max_len=16)
    with pytest.raises(ConfigError, match="empty"):
        engine.add(Request([], 4))
    with pytest.raises(ConfigError, match="context holds 16"):
        engine.add(Request(list(range(3, 20)), 4))
    with pytest.raises(ConfigError, match="max_new_tokens"):
        engine.add(Request([3, 4], 0))
    assert not engine.has_work
