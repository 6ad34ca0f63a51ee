"""A round's steps called directly (engine/verify.py, engine/commit.py) and engine/round.py's
time shares: what one round commits, writes to the K/V cache and counts (mutation testing, issue
29: the counters and time shares the bench and the controllers read)."""

from __future__ import annotations

import time

import pytest
import torch

from enumerate_law import one_thread

from outrider.control.controllers import FixedController
from outrider.drafters.ngram import NgramDrafter
from outrider.engine.commit import commit
from outrider.engine.generate import generate_ids
from outrider.engine.loop import EngineLoop
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.engine.verify import Forward, verify
from outrider.models.batch import pack
from outrider.spec.shapes import parse_shape
from outrider.spec.types import DraftTree
from outrider.weights.loader import load_decoder

PROMPTS = [[5, 9, 14, 5, 9], [20, 21, 22]]


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def target(tiny_folders):
    return load_decoder(tiny_folders["llama"], "cpu")


def started(target, prompts=PROMPTS):
    """An engine whose requests have their prompts in the cache and are ready for a round, and
    each prompt's greedy continuation."""
    refs = [generate_ids(target, [Request(p, 12)], set())[0].token_ids for p in prompts]
    engine = EngineLoop(target, set(), max_running=len(prompts), max_len=64)
    for p in prompts:
        engine.add(Request(p, 12))
    engine.scheduler.admit()
    for seq in engine.scheduler.running:
        engine.cache.set_length(seq.slot, 0)
    engine._prefill()
    seqs = list(engine.scheduler.running)
    assert all(s.decoding for s in seqs)
    return engine, seqs, refs


def verified(target, cache, seqs, trees):
    """The round's verify and commit steps on given trees: each sequence's result (None where it
    failed) and the failures by batch index."""
    forward = Forward.run(target, cache, seqs, trees, list(range(len(seqs))))
    results, failed = verify(seqs, trees, forward)
    failed |= commit(cache, seqs, trees, results, forward)
    return [results.get(b) for b in range(len(seqs))], failed


class Slow(NgramDrafter):
    """n-grams, each proposal taking at least `seconds`."""

    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds

    def propose_batch(self, seq_ids, tokens, budgets):
        time.sleep(self.seconds)
        return super().propose_batch(seq_ids, tokens, budgets)


def test_a_round_shares_its_time_among_its_sequences(target):
    """The proposal's time and the verification's are split evenly among the round's sequences,
    and a step's shares add up to no more than the step."""
    spec = Speculator(SpecOptions("ngram", "chain", "fixed:3"), Slow(0.05), FixedController(3), parse_shape("chain"))
    engine = EngineLoop(target, set(), spec, max_running=2, max_len=64)
    for p in PROMPTS:
        engine.add(Request(p, 12))
    engine.step()  # the prompts, and a first round
    seqs = list(engine.scheduler.running)
    before = [(s.stats.draft_s, s.stats.verify_s) for s in seqs]
    begin = time.perf_counter()
    engine.step()  # one round
    wall = time.perf_counter() - begin
    drafted = [s.stats.draft_s - d for s, (d, _) in zip(seqs, before)]
    spent = [s.stats.verify_s - v for s, (_, v) in zip(seqs, before)]
    assert drafted[0] == drafted[1] and 0.05 <= sum(drafted)
    assert spent[0] == spent[1] and 0.0 < sum(spent) and sum(drafted) + sum(spent) <= wall


def test_a_round_commits_counts_and_keeps_the_cache_in_step(target):
    """Sequence 0 drafts a static tree whose accepted path is not contiguous, sequence 1 a chain
    rejected at once: the tokens, the cache lengths and every counter of RoundStats."""
    engine, seqs, refs = started(target)
    a, b = seqs
    lens = [engine.cache.lengths[s.slot] for s in seqs]
    assert lens == [len(p) - 1 for p in PROMPTS]
    wrong = (refs[1][0] + 1) % 96
    tree_a = DraftTree(torch.tensor([a.tokens[-1], (refs[0][0] + 1) % 96, refs[0][0], refs[0][1], refs[0][2]]),
                       torch.tensor([-1, 0, 0, 2, 3]))  # node 1 a wrong sibling: the path is 0, 2, 3, 4
    tree_b = DraftTree.chain(b.tokens[-1], [wrong, 7])
    results, failed = verified(target, engine.cache, seqs, [tree_a, tree_b])
    assert failed == {} and [r.accepted_nodes for r in results] == [[2, 3, 4], []]
    assert a.output == refs[0][:4] and b.output == refs[1][:1]
    assert [engine.cache.lengths[s.slot] for s in seqs] == [lens[0] + 4, lens[1] + 1]
    for s, want in ((a, dict(rounds=1, committed=4, drafted=4, accepted_by_position=[1, 1, 1],
                             proposed_by_position=[1, 1, 1], accepted_length_hist=[0, 0, 0, 1],
                             committed_by_round=[4])),
                    (b, dict(rounds=1, committed=1, drafted=2, accepted_by_position=[0, 0],
                             proposed_by_position=[1, 1], accepted_length_hist=[1], committed_by_round=[1]))):
        assert {k: getattr(s.stats, k) for k in want} == want
    # a second round: root-only for a (nothing drafted), a one-draft chain accepted for b
    verified(target, engine.cache, seqs, [DraftTree.root_only(a.tokens[-1]), DraftTree.chain(b.tokens[-1], [refs[1][1]])])
    assert a.output == refs[0][:5] and b.output == refs[1][:3]
    assert (a.stats.rounds, a.stats.committed, a.stats.drafted, a.stats.committed_by_round) == (2, 5, 4, [4, 1])
    assert (a.stats.accepted_length_hist, a.stats.proposed_by_position) == ([1, 0, 0, 1], [1, 1, 1])
    assert (b.stats.accepted_by_position, b.stats.proposed_by_position, b.stats.accepted_length_hist) == \
        ([1, 0], [2, 1], [1, 1])
    # a third: a one-draft chain accepted for a, root-only for b (counts that grow past 1)
    verified(target, engine.cache, seqs, [DraftTree.chain(a.tokens[-1], [refs[0][5]]), DraftTree.root_only(b.tokens[-1])])
    assert a.output == refs[0][:7] and b.output == refs[1][:4]
    assert (a.stats.accepted_by_position, a.stats.proposed_by_position, a.stats.accepted_length_hist) == \
        ([2, 1, 1], [2, 1, 1], [1, 1, 0, 1])
    assert (b.stats.rounds, b.stats.accepted_length_hist, b.stats.committed_by_round) == (3, [2, 1], [1, 2, 1])
    # what the cache holds is what a fresh prefill of the committed tokens writes (the compacted rows)
    for s in seqs:
        n = engine.cache.lengths[s.slot]
        fresh = target.new_cache(1, 64)
        target.forward(pack([0], [0], [torch.tensor(s.tokens[:n])], logits="none", scratch_row=fresh.scratch_row),
                       fresh)
        for mine, theirs in zip((*engine.cache.k, *engine.cache.v), (*fresh.k, *fresh.v)):
            torch.testing.assert_close(mine[s.slot, :, :n], theirs[0, :, :n], atol=1e-5, rtol=1e-5)


def test_the_round_applies_the_processing_and_the_grammar_to_the_target_logits(target):
    """A logit bias (spec/processing.py) and a grammar's allowed tokens (spec/grammar.py; a stand-in
    state here) decide what a round commits; the grammar follows the committed tokens, and its
    error fails that sequence alone."""
    from outrider.sampling import SamplingParams
    from outrider.spec.grammar import GrammarError

    refs = [generate_ids(target, [Request(p, 4)], set())[0].token_ids for p in PROMPTS]
    engine = EngineLoop(target, set(), max_running=2, max_len=64)
    biased = (refs[0][0] + 3) % 96
    engine.add(Request(PROMPTS[0], 4, SamplingParams(logit_bias={biased: 100.0})))
    engine.add(Request(PROMPTS[1], 4))
    engine.scheduler.admit()
    for seq in engine.scheduler.running:
        engine.cache.set_length(seq.slot, 0)
    engine._prefill()
    a, b = engine.scheduler.running
    assert a.processor is not None and b.processor is None

    class Grammar:  # allows one token at each node, and remembers what was committed
        def __init__(self, fail=False):
            self.committed, self.fail = [], fail

        def commit(self, tokens):
            self.committed.append(list(tokens))
            if self.fail:
                raise GrammarError("the grammar refused a committed token: for the test")

    forced = (refs[1][0] + 5) % 96
    b.grammar, b.allowed = Grammar(), torch.zeros(2, 96, dtype=torch.bool)
    b.allowed[0, forced] = True  # the root's row: only `forced`; node 1 (a wrong draft) allows all
    b.allowed[1] = True
    trees = [DraftTree.root_only(a.tokens[-1]), DraftTree.chain(b.tokens[-1], [(forced + 1) % 96])]
    _, failed = verified(target, engine.cache, [a, b], trees)
    assert failed == {} and a.output == [biased] and b.output == [forced]
    assert b.grammar.committed == [[forced]] and b.allowed is None  # the masks were this round's only
    b.grammar.fail = True
    results, failed = verified(target, engine.cache, [a, b], [DraftTree.root_only(a.tokens[-1]),
                                                              DraftTree.root_only(b.tokens[-1])])
    assert failed == {1: "the grammar refused a committed token: for the test"}
    assert a.output == [biased, biased] and results[0] is not None


def test_the_processing_and_the_grammar_apply_when_every_sequence_has_them(target):
    """A round whose sequences all have a processor and no grammar mask, or all a grammar mask and
    no processor, processes its logits too (the shortcut is for a round with neither)."""
    from outrider.sampling import SamplingParams

    refs = [generate_ids(target, [Request(p, 4)], set())[0].token_ids for p in PROMPTS]
    biased, forced = (refs[0][0] + 3) % 96, (refs[1][0] + 5) % 96
    engine = EngineLoop(target, set(), max_running=2, max_len=64)
    engine.add(Request(PROMPTS[0], 4, SamplingParams(logit_bias={biased: 100.0})))
    engine.add(Request(PROMPTS[1], 4))
    engine.scheduler.admit()
    for seq in engine.scheduler.running:
        engine.cache.set_length(seq.slot, 0)
    engine._prefill()
    a, b = engine.scheduler.running
    assert a.processor is not None and a.allowed is None
    _, failed = verified(target, engine.cache, [a], [DraftTree.root_only(a.tokens[-1])])
    assert failed == {} and a.output == [biased]  # the processing alone in its round
    b.allowed = torch.zeros(1, 96, dtype=torch.bool)
    b.allowed[0, forced] = True
    assert b.processor is None
    _, failed = verified(target, engine.cache, [b], [DraftTree.root_only(b.tokens[-1])])
    assert failed == {} and b.output == [forced]  # a grammar's mask alone in its round


def test_a_ragged_rounds_padding_writes_the_caches_scratch_row(target, monkeypatch):
    """Trees of 5 and 3 nodes in one verify forward: the shorter slot's 2 padded tokens write the
    cache's scratch row (pack's default, row -1, is the same row for torch's indexing, but
    decoder_layer.c would write row -1 of slot 0 before the cache's memory)."""
    engine, seqs, refs = started(target)
    a, b = seqs
    seen, forward = [], target.forward

    def recording(batch, cache):
        seen.append(batch.rows.tolist())
        return forward(batch, cache)

    monkeypatch.setattr(target, "forward", recording)
    lens = [engine.cache.lengths[s.slot] for s in seqs]
    verified(target, engine.cache, seqs, [DraftTree.chain(a.tokens[-1], refs[0][:4]),
                                          DraftTree.chain(b.tokens[-1], refs[1][:2])])
    scratch = engine.cache.scratch_row
    assert scratch == 64 and seen == [[list(range(lens[0], lens[0] + 5)),
                                       list(range(lens[1], lens[1] + 3)) + [scratch, scratch]]]


def test_greedy_rounds_go_through_the_registered_greedy_verifier(target, monkeypatch):
    """Each greedy sequence of a round is verified by its registered verifier (greedy_chain here),
    given its own rows' argmax from the round's one read of every row (one `choices` a round,
    whatever the batch): the output is the target's own."""
    from outrider.engine import verify as verify_step
    from outrider.spec.verify_greedy import GreedyVerifier

    calls, reads, verifies = [], [], []
    from_choices, choices, forward = GreedyVerifier.from_choices, verify_step.choices, target.forward

    def counted(self, tree, choice):
        calls.append((tree.size, len(choice)))
        return from_choices(self, tree, choice)

    def read(logits):
        reads.append(logits.shape[0])
        return choices(logits)

    def forwarded(batch, cache):
        verifies.append(not batch.fills_only)
        return forward(batch, cache)

    monkeypatch.setattr(GreedyVerifier, "from_choices", counted)
    monkeypatch.setattr(verify_step, "choices", read)
    monkeypatch.setattr(target, "forward", forwarded)
    plain = [generate_ids(target, [Request(p, 12)], set())[0].token_ids for p in PROMPTS]  # greedy_chain too
    assert len(calls) == 2 * 12 and all(n == m == 1 for n, m in calls)
    calls.clear(), reads.clear(), verifies.clear()
    spec = Speculator(SpecOptions("ngram", "chain", "fixed:3"), NgramDrafter(), FixedController(3), parse_shape("chain"))
    done = generate_ids(target, [Request(p, 12) for p in PROMPTS], set(), speculation=spec)
    assert [c.token_ids for c in done] == plain
    assert len(calls) == sum(c.round_stats.rounds for c in done) and all(n == m for n, m in calls)
    assert max(n for n, _ in calls) > 1  # some rounds drafted
    assert len(reads) == sum(verifies) < len(calls)  # one read a round, not one a sequence
