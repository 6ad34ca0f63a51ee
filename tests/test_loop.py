"""engine/loop.py's scheduling inside a step: the prefill budget spent in order, a shared prompt's
K/V copied only when it is there, cancellation, events and time figures (mutation testing,
issue 29: each of these changed no output token in the other tests when mutated)."""

from __future__ import annotations

import time

import pytest
import torch

from enumerate_law import one_thread

from outrider.control.controllers import FixedController
from outrider.drafters.ngram import NgramDrafter
from outrider.engine.constrain import constrain as constrain_trees
from outrider.engine.generate import generate_ids
from outrider.engine.loop import EngineLoop
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.spec.shapes import parse_shape
from outrider.weights.loader import load_decoder


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def target(tiny_folders):
    return load_decoder(tiny_folders["llama"], "cpu")


def ngram() -> Speculator:
    return Speculator(SpecOptions("ngram", "chain", "fixed:3"), NgramDrafter(), FixedController(3), parse_shape("chain"))


def alone(target, prompt, n=6):
    return generate_ids(target, [Request(list(prompt), n)], set())[0].token_ids


class Fills:
    """Records the prefill forwards (those that only write the cache): (slots, first cache row, tokens) each."""

    def __init__(self, target, monkeypatch):
        self.seen, forward = [], target.forward

        def recording(batch, cache):
            if batch.fills_only:
                real = (batch.rows != cache.scratch_row).sum(-1).tolist()
                self.seen.append((batch.slot_ids, batch.positions[:, 0].tolist(), real))
            return forward(batch, cache)

        monkeypatch.setattr(target, "forward", recording)


def drain(engine, steps=40):
    """Step until nothing is left (at most `steps`): the completions by request id, and the events."""
    done, events = {}, []
    for _ in range(steps):
        if not engine.has_work:
            break
        for event in engine.step():
            events.append(event)
            if event.completion is not None:
                done[event.request_id] = event.completion
    assert not engine.has_work, "the engine did not finish"
    return done, events


def test_chunked_prefill_spends_the_budget_in_order(target, monkeypatch):
    """chunk_size 3: each step's prefill takes up to 3 prompt tokens, oldest request first, a
    request's whole remainder when it fits, the rest of the budget for the next; a one-token
    prompt has nothing to prefill and decodes at once."""
    prompts = [[7], [8, 9, 10], list(range(11, 20)), [30, 31, 32, 33, 34]]  # 0, 2, 8, 4 tokens to prefill
    fills = Fills(target, monkeypatch)
    engine = EngineLoop(target, set(), max_running=4, max_len=64, chunk_size=3)
    ids = [engine.add(Request(p, 6)) for p in prompts]
    done, _ = drain(engine)
    assert fills.seen == [([1, 2], [0, 0], [2, 1]), ([2], [1], [3]), ([2], [4], [3]), ([2, 3], [7, 0], [1, 2]),
                          ([3], [2], [2])]
    monkeypatch.undo()
    for i, p in zip(ids, prompts):
        assert done[i].token_ids == alone(target, p) and done[i].finish_reason == "length"


def test_prompt_logprobs_over_chunks_equal_the_whole_prompts(target):
    prompt = list(range(40, 50))
    whole = generate_ids(target, [Request(prompt, 3, prompt_logprobs=2)], set())[0]
    engine = EngineLoop(target, set(), max_running=1, max_len=64, chunk_size=4)
    rid = engine.add(Request(prompt, 3, prompt_logprobs=2))
    chunked = drain(engine)[0][rid]
    assert chunked.token_ids == whole.token_ids and chunked.prompt_logprobs[0] is None
    assert [x.token for x in chunked.prompt_logprobs[1:]] == prompt[1:]
    for x, y in zip(chunked.prompt_logprobs[1:], whole.prompt_logprobs[1:]):
        assert abs(x.logprob - y.logprob) < 1e-4 and [t for t, _ in x.top] == [t for t, _ in y.top]


@pytest.mark.parametrize("speculation", [False, True])
def test_a_shared_prompt_is_copied_only_once_it_is_in_the_cache(target, monkeypatch, speculation):
    """prefill_from copies the source's prompt K/V when the source decodes with the same prompt
    (also with an n-gram drafter, which reads no hidden states); not from a source whose prompt
    is still being prefilled in this very step, nor from one with another prompt."""
    prompt, other = [50, 51, 52, 53, 54, 55], [60, 61, 62, 63, 64, 65]
    fills = Fills(target, monkeypatch)
    engine = EngineLoop(target, set(), ngram() if speculation else None, max_running=4, max_len=64)
    src = engine.add(Request(prompt, 6))
    early = engine.add(Request(prompt, 6, prefill_from=src))  # same step: src is not in the cache yet
    events = engine.step()
    assert fills.seen == [([0, 1], [0, 0], [5, 5])] and not any(e.completion for e in events)
    late = engine.add(Request(prompt, 6, prefill_from=src))  # src decodes now: copied, no forward
    stranger = engine.add(Request(other, 6, prefill_from=src))  # another prompt: its own prefill
    done, _ = drain(engine)
    assert fills.seen[1:] == [([3], [0], [5])]
    monkeypatch.undo()
    for rid, p in ((src, prompt), (early, prompt), (late, prompt), (stranger, other)):
        assert done[rid].token_ids == alone(target, p), rid


def test_cancelled_requests_end_with_no_new_tokens_and_no_error(target):
    engine = EngineLoop(target, set(), ngram(), max_running=1, max_len=64)
    running = engine.add(Request([5, 6, 7, 5, 6], 8))
    waiting = engine.add(Request([9, 10, 11], 8))
    engine.step()
    assert (engine.num_running, engine.num_waiting) == (1, 1)
    engine.cancel(waiting)  # never got a slot
    engine.cancel(running)
    events = engine.step()
    assert sorted(e.request_id for e in events) == [running, waiting] and not engine.has_work
    for e in events:
        assert e.new_tokens == [] and e.completion.finish_reason == "cancelled" and e.completion.error is None
    assert len(events[[e.request_id for e in events].index(running)].completion.token_ids) >= 1
    assert events[[e.request_id for e in events].index(waiting)].completion.token_ids == []


def test_time_figures_add_up_within_the_total(target):
    done = generate_ids(target, [Request([5, 6, 7, 5, 6, 7, 5], 12)], set(), speculation=ngram())[0]
    s = done.stats
    assert s["rounds"] < 12  # the n-gram drafts were accepted sometimes: rounds drafted
    for key in ("prefill_s", "draft_s", "verify_s"):
        assert 0.0 < s[key] <= s["total_s"], key
    assert s["prefill_s"] + s["draft_s"] + s["verify_s"] <= s["total_s"] + 1e-9


# --- what no output token shows (mutation testing, issue 29, the loop group's survivors) ---------

class SpyController(FixedController):
    """fixed:3, recording the budgets asked for (sequences, batch size) and the verify times seen."""

    def __init__(self):
        super().__init__(3)
        self.asked, self.verified = [], []

    def budgets(self, seq_ids, batch_size, nodes_for):
        self.asked.append((list(seq_ids), batch_size))
        return super().budgets(seq_ids, batch_size, nodes_for)

    def observe_verify_time(self, batch_size, width, seconds):
        self.verified.append((batch_size, width, seconds))


class SpyDrafter(NgramDrafter):
    """n-grams, recording each proposal's sequences, node budgets and widest tree."""

    def __init__(self):
        super().__init__()
        self.proposed = []

    def propose_batch(self, seq_ids, tokens, budgets):
        trees = super().propose_batch(seq_ids, tokens, budgets)
        self.proposed.append((list(seq_ids), [b.nodes for b in budgets], max(t.size for t in trees)))
        return trees


class Spy(Speculator):
    """n-grams under fixed:3, recording what the engine tells the speculator (the cache and batch it
    prepares for), its controller (budgets, verify times) and its drafter (proposals)."""

    def __init__(self):
        super().__init__(SpecOptions("ngram", "chain", "fixed:3"), SpyDrafter(), SpyController(), parse_shape("chain"))
        self.prepared = []

    def prepare(self, cache, max_batch):
        self.prepared.append((cache, max_batch))
        super().prepare(cache, max_batch)


def test_defaults_refusals_and_the_rows_a_request_reserves(target):
    """16 slots by default; chunk_size 1 is a chunk, 0 is refused; a request reserves its prompt,
    its new tokens and one round's tree (the root alone without speculation); the refusals word
    for word."""
    from outrider.errors import ConfigError

    engine = EngineLoop(target, set())
    assert engine.cache.num_slots == engine.scheduler.num_slots == 16
    with pytest.raises(ConfigError) as err:
        EngineLoop(target, set(), max_len=64, chunk_size=0)
    assert str(err.value) == "chunk_size must be a positive integer, got 0"
    one = EngineLoop(target, set(), max_running=1, max_len=64, chunk_size=1)
    rid = one.add(Request([5, 6, 7, 8], 3))
    assert drain(one)[0][rid].token_ids == alone(target, [5, 6, 7, 8], 3)
    plain = EngineLoop(target, set(), max_running=1, max_len=64, max_kv_rows=12)
    assert plain.check(Request([5, 6, 7, 8, 9], 6)) == 12
    drafting = EngineLoop(target, set(), ngram(), max_running=1, max_len=64)
    assert drafting.check(Request([5, 6, 7, 8, 9], 6)) == 15
    assert drafting.check(Request([5, 6, 7, 8, 9], 6, speculate=False)) == 12  # plain: no tree's rows
    rid = drafting.add(Request([5, 6, 7, 8, 9], 6, speculate=False))
    assert drain(drafting)[0][rid].token_ids == alone(target, [5, 6, 7, 8, 9], 6)
    two = EngineLoop(target, set(), max_running=2, max_len=64, max_kv_rows=20)
    ids = [two.add(Request([5, 6, 7, 8, 9], 6)), two.add(Request([9, 8, 7, 6, 5], 6))]  # 12 rows each
    two.step()
    assert (two.num_running, two.num_waiting) == (1, 1)  # the rows, not the slots, hold the second back
    done = drain(two)[0]
    assert [done[i].token_ids for i in ids] == [alone(target, [5, 6, 7, 8, 9], 6), alone(target, [9, 8, 7, 6, 5], 6)]
    with pytest.raises(ConfigError) as err:
        plain.check(Request([5, 6, 7, 8, 9], 7))
    assert str(err.value) == ("the request needs 13 K/V rows but the engine holds 12: "
                              "ask for fewer tokens or raise the K/V row limit")
    with pytest.raises(ConfigError) as err:
        plain.check(Request([5, 6, 7], 2, stop=("w9",)))
    assert str(err.value) == "stop strings need the engine's tokenizer: build the EngineLoop with decode="


def test_what_the_engine_tells_the_speculator(target):
    """prepare gets the engine's cache and slot count; budgets are asked for the requests that
    draft (not speculate=False, not max_draft_tokens=0; max_draft_tokens=1 does) with the round's
    whole batch size, and each one's nodes are capped by its free rows, themselves capped at
    max_draft_tokens + 1 (the root's row included); the verify time observed is the round's
    batch, its widest tree and seconds within the step."""
    spec = Spy()
    engine = EngineLoop(target, set(), spec, max_running=4, max_len=64)
    assert spec.prepared == [(engine.cache, 4)] and spec.prepared[0][0] is engine.cache
    prompts = [[5, 6, 7, 5, 6, 7, 5], [8, 9, 10, 8, 9, 10, 8], [11, 12, 13], [14, 15, 16]]
    ids = [engine.add(Request(prompts[0], 8)), engine.add(Request(prompts[1], 8, max_draft_tokens=1)),
           engine.add(Request(prompts[2], 8, speculate=False)), engine.add(Request(prompts[3], 8, max_draft_tokens=0))]
    assert [engine._seqs[i].speculate for i in ids] == [True, True, False, False]
    begin = time.perf_counter()
    engine.step()
    wall = time.perf_counter() - begin
    assert spec.controller.asked[0] == ([ids[0], ids[1]], 4)
    assert spec.drafter.proposed[0][:2] == ([ids[0], ids[1]], [3, 1])  # 58 free rows: 3 nodes; 2: 1
    (batch, width, seconds), = spec.controller.verified
    assert (batch, width) == (4, spec.drafter.proposed[0][2]) and 0.0 < seconds < wall
    done, _ = drain(engine)
    for i, p in zip(ids, prompts):
        assert done[i].token_ids == alone(target, p, 8), i


class FailsToPropose(NgramDrafter):
    """n-grams, except that proposing for a sequence whose prompt starts with `bad` raises."""

    def __init__(self, bad: int):
        super().__init__()
        self.bad, self.first = bad, {}

    def start(self, seq_id, prompt, params=None):
        self.first[seq_id] = prompt[0]
        super().start(seq_id, prompt, params)

    def propose(self, seq_id, tokens, budget):
        if self.first[seq_id] == self.bad:
            raise RuntimeError("injected fault in propose")
        return super().propose(seq_id, tokens, budget)

    def finish(self, seq_id, tokens):
        if seq_id not in self._states:  # finishing a sequence it never started is the engine's bug
            raise KeyError(f"sequence {seq_id} never started")
        super().finish(seq_id, tokens)


def test_events_carry_every_token_and_logprob(target):
    """Each request's events, the last one's included, carry its tokens and their logprobs in order;
    a request failing first in the batch does not hide the others' events of that step; the
    failed and the cancelled requests' last events have no text."""
    spec = Speculator(SpecOptions("ngram", "chain", "fixed:3"), FailsToPropose(40), FixedController(3),
                      parse_shape("chain"))
    engine = EngineLoop(target, set(), spec, max_running=3, max_len=64)
    bad = engine.add(Request([40, 41, 42], 8))
    good = engine.add(Request([5, 6, 7, 5, 6, 7, 5], 10, logprobs=2))
    plain = engine.add(Request([8, 9, 10], 7, logprobs=0, speculate=False))
    done, events = drain(engine)
    assert (done[bad].finish_reason, done[bad].token_ids) == ("error", [])
    assert done[bad].logprobs is None and done[bad].prompt_logprobs is None  # not asked for
    assert [(e.new_tokens, e.text) for e in events if e.request_id == bad] == [([], "")]
    for rid, prompt, n in ((good, [5, 6, 7, 5, 6, 7, 5], 10), (plain, [8, 9, 10], 7)):
        mine = [e for e in events if e.request_id == rid]
        assert [t for e in mine for t in e.new_tokens] == done[rid].token_ids == alone(target, prompt, n)
        assert [x for e in mine for x in e.logprobs] == done[rid].logprobs and len(done[rid].logprobs) == n
        assert [x.token for x in done[rid].logprobs] == done[rid].token_ids
        assert all(len(e.logprobs) == len(e.new_tokens) for e in mine)
    # a speculating request cancelled while its prompt is prefilled: the drafter never started it
    engine = EngineLoop(target, set(), spec, max_running=1, max_len=64, chunk_size=2)
    rid = engine.add(Request(list(range(20, 30)), 4))
    assert engine.step() == [] and not engine._seqs[rid].decoding
    engine.cancel(rid)
    event, = engine.step()
    assert (event.completion.finish_reason, event.completion.error, event.text) == ("cancelled", None, "")


def test_requests_added_while_others_decode_start_in_the_next_step(target):
    """A request whose prompt is copied from a decoding one, and one after it that is prefilled,
    both start (and commit a token) in the step after they were added."""
    engine = EngineLoop(target, set(), max_running=3, max_len=64)
    first = engine.add(Request([5, 6, 7, 8], 12))
    engine.step()
    copied = engine.add(Request([5, 6, 7, 8], 3, prefill_from=first))
    second = engine.add(Request([9, 10, 11], 3))
    events = engine.step()
    assert sorted((e.request_id, len(e.new_tokens)) for e in events) == [(first, 1), (copied, 1), (second, 1)]
    done, rest = drain(engine)
    assert done[copied].token_ids == alone(target, [5, 6, 7, 8], 3)
    assert done[second].token_ids == alone(target, [9, 10, 11], 3)
    assert [e.request_id for e in rest if e.completion is not None] == [copied, second, first]


class Forcing:
    """A stand-in grammar state (spec/grammar.py's): forces `tokens` next, allows every token,
    and records the limits and prune flags the engine asks with; `error`: constrain raises."""

    def __init__(self, tokens, error=None):
        self.tokens, self.error, self.limits, self.prunes = tokens, error, [], []

    def forced(self, limit):
        self.limits.append(limit)
        return self.tokens[:limit] if limit > 0 else []

    def constrain(self, tree, prune):
        from outrider.spec.grammar import GrammarError

        self.prunes.append(prune)
        if self.error:
            raise GrammarError(self.error)
        return tree, torch.ones(tree.size, 96, dtype=torch.bool)


def test_a_grammar_drafts_its_forced_tokens_and_prunes_where_the_verifier_allows(target):
    """engine/constrain.py with stand-in grammars: forced tokens (at most the tree's headroom and the
    slot's free rows less the root) replace a drafter's tree no longer than them, after the last
    committed token, with point-mass draft_probs where the drafter gave draft_probs; the tree is
    pruned where the request drafts grammar-aware and its verifier reads no draft_probs or is
    greedy; a grammar's error is its request's."""
    from outrider.sampling import SamplingParams
    from outrider.spec.types import DraftTree

    engine = EngineLoop(target, set(), ngram(), max_running=4, max_len=64)
    sampled = SamplingParams(temperature=0.8, seed=1)
    for prompt, params, aware in (([5, 6, 7, 5, 6], SamplingParams(), True), ([20, 21, 22, 23], SamplingParams(), True),
                                  ([30, 31, 32, 33], sampled, True), ([40, 41, 42, 43], sampled, False)):
        engine.add(Request(prompt, 8, params, grammar_drafting=aware))
    engine.step()  # every prompt in the cache, one round each
    plain, greedy, drawn, unaware = engine.scheduler.running
    assert engine.headroom == 4 and greedy.tokens[1] != greedy.tokens[-1]

    def constrain(seq, grammar, drafts, probs=None):
        seq.grammar = grammar
        trees = [DraftTree.root_only(plain.tokens[-1]), DraftTree.chain(seq.tokens[-1], drafts, probs)]
        made, errors = constrain_trees([plain, seq], trees, {}, engine.cache, engine.headroom, 96)  # no grammar first
        assert made[0] is trees[0] and trees[1].tokens.tolist() == [seq.tokens[-1], *drafts]  # a new list
        return made[1], errors

    g = Forcing([50, 51, 52, 53, 54])  # as many forced tokens as drafts (3, the headroom less the root)
    tree, errors = constrain(greedy, g, [60, 61, 62])
    assert errors == {} and tree.tokens.tolist() == [greedy.tokens[-1], 50, 51, 52] and tree.draft_probs is None
    assert (g.limits, g.prunes) == ([3], [True]) and greedy.allowed.shape == (4, 96)
    g = Forcing([50, 51])  # fewer forced tokens than drafts: the drafts stay
    tree, _ = constrain(greedy, g, [60, 61, 62])
    assert tree.tokens.tolist() == [greedy.tokens[-1], 60, 61, 62] and g.limits == [3]
    engine.cache.set_length(greedy.slot, 61)  # 3 free rows: the root and 2 forced tokens
    g = Forcing([50, 51, 52, 53, 54])
    tree, _ = constrain(greedy, g, [60])
    assert tree.tokens.tolist() == [greedy.tokens[-1], 50, 51] and g.limits == [2]
    g = Forcing([50, 51, 52])  # sampled, with draft_probs: point masses, not pruned
    tree, _ = constrain(drawn, g, [60, 61, 62], torch.full((4, 96), 1 / 96))
    assert tree.tokens.tolist() == [drawn.tokens[-1], 50, 51, 52] and g.prunes == [False]
    want = torch.zeros(4, 96)
    want[[0, 1, 2], [50, 51, 52]] = 1.0
    assert torch.equal(tree.draft_probs, want)
    g = Forcing([])  # sampled without draft_probs (the tree walk): pruned
    tree, _ = constrain(drawn, g, [60])
    assert tree.tokens.tolist() == [drawn.tokens[-1], 60] and g.prunes == [True]
    g = Forcing([50, 51, 52])  # grammar_drafting off: nothing forced, nothing pruned
    tree, _ = constrain(unaware, g, [60])
    assert tree.tokens.tolist() == [unaware.tokens[-1], 60] and (g.limits, g.prunes) == ([], [False])
    _, errors = constrain(greedy, Forcing([], error="the grammar allows no token here (for the test)"), [60])
    assert errors == {1: "the grammar allows no token here (for the test)"}


def test_each_request_is_processed_with_its_own_params_prompt_and_vocabulary(target):
    """The repetition penalty reads the prompt (its greedy token here is a prompt token, which
    the penalty makes lose to another), the logit bias the params."""
    from outrider.models.batch import pack
    from outrider.sampling import SamplingParams
    from outrider.spec.processing import PathProcessor

    prompt = [36, 37, 38, 39, 40]
    cache = target.new_cache(1, 64)
    raw = target.forward(pack([0], [0], [torch.tensor(prompt)], logits="last", scratch_row=cache.scratch_row),
                         cache).logits.reshape(-1, 96)[-1]
    penalty = SamplingParams(repetition_penalty=3.0)
    want = int(PathProcessor(penalty, prompt, 96).apply(raw[None], torch.tensor([prompt[-1]]),
                                                        torch.tensor([-1])).argmax())
    assert int(raw.argmax()) in prompt and want != int(raw.argmax())
    engine = EngineLoop(target, set(), max_running=3, max_len=64)
    ids = [engine.add(Request(prompt, 1)), engine.add(Request(prompt, 1, penalty)),
           engine.add(Request(prompt, 1, SamplingParams(logit_bias={7: 100.0})))]
    done, _ = drain(engine)
    assert [done[i].token_ids for i in ids] == [[int(raw.argmax())], [want], [7]]
