"""The rows a head drafter has not yet written (drafters/pending.py), and what waiting buys.

- PendingRows keeps the parts as they came and joins them in order, once; a write that fails
  (joined, not cleared) loses none.
- An EAGLE-3 head writes a prompt's rows at its first proposal, not at start: a request the
  controller never lets draft never runs the head; one that drafts later gets the drafts it
  would have got from rows written at start (one forward over all that waited, against one for
  the prompt and one a round), and greedy output stays autoregressive output either way.
"""

import pytest
import torch
from eagle3_tiny import target_with_head
from enumerate_law import one_thread
from test_eagle3_spec import PROMPTS

from outrider.drafters.pending import PendingRows
from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.heads.eagle3.head import Eagle3Head
from outrider.models.batch import pack
from outrider.spec.types import Budget, VerifyResult
from outrider.weights.loader import load_decoder


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder, head = target_with_head(tmp_path_factory.mktemp("pending"))
    return folder, load_decoder(folder, "cpu"), head


def test_parts_join_in_order_and_a_failed_write_loses_none():
    rows = PendingRows(torch.zeros(0, 3))
    assert rows.rows == 0 and rows.joined().shape == (0, 3)
    parts = [torch.full((n, 3), float(i)) for i, n in enumerate((2, 1, 3))]
    for part in parts:
        rows.add(part)
    assert rows.rows == 6
    assert torch.equal(rows.joined(), torch.cat(parts))
    assert torch.equal(rows.joined(), torch.cat(parts)) and rows.rows == 6  # still waiting
    rows.add(torch.full((1, 3), 9.0))
    assert torch.equal(rows.joined(), torch.cat(parts + [torch.full((1, 3), 9.0)]))
    rows.clear()
    assert rows.rows == 0 and rows.joined().shape == (0, 3)
    first = torch.arange(6.0).view(2, 3)
    started = PendingRows(first)
    started.add(torch.ones(1, 3))
    assert torch.equal(started.joined(), torch.cat((first, torch.ones(1, 3)))) and started.rows == 3


def test_a_request_that_never_drafts_never_runs_the_head(setup, monkeypatch):
    folder, target, head = setup
    calls = []
    forward = Eagle3Head.forward
    monkeypatch.setattr(Eagle3Head, "forward", lambda self, *a, **k: calls.append(1) or forward(self, *a, **k))
    requests = lambda: [Request(list(p), 12) for p in PROMPTS]  # noqa: E731
    plain = [f.token_ids for f in generate_ids(target, requests(), set())]
    spec = Speculator.build(SpecOptions(f"eagle3:{head}", "chain", "fixed:0"), target, folder)
    assert [f.token_ids for f in generate_ids(target, requests(), set(), speculation=spec)] == plain
    assert calls == []  # fixed:0: the prompts' rows and every round's waited, unwritten
    spec = Speculator.build(SpecOptions(f"eagle3:{head}", "chain", "fixed:3"), target, folder)
    assert [f.token_ids for f in generate_ids(target, requests(), set(), speculation=spec)] == plain
    assert calls  # the same head drafts once it may


@pytest.mark.parametrize("tree", ["chain", "static:2,2,1"])
def test_rows_written_late_draft_as_rows_written_at_once(setup, tree):
    """Two drafters over the same rounds: one proposes every round (its rows written as they come),
    the other only in the last round (the prompt's and four rounds' rows in one forward): the
    last round's tree is the same."""
    folder, target, head = setup
    prompt = PROMPTS[3]
    out = target.forward(pack([0], [0], [torch.tensor(prompt + [5, 6, 7, 1, 2])], logits="none",
                              hidden_layers=(1, 2, 3)), target.new_cache(1, 32))
    feats = torch.stack([out.hidden[layer][0] for layer in (1, 2, 3)], dim=1)  # [n, 3, E]
    drafters = [Speculator.build(SpecOptions(f"eagle3:{head}", tree, "fixed:3"), target, folder).drafter
                for _ in range(2)]
    for d in drafters:
        d.start(0, list(prompt), hidden=feats[: len(prompt) - 1])
    tokens = list(prompt)
    for extra in (5, 6, 7, 1):  # four rounds, each committing one token (no draft accepted)
        drafters[0].propose(0, tokens, Budget(3, 8))
        n = len(tokens)
        for d in drafters:
            d.update(0, VerifyResult([], [extra]), hidden=feats[n - 1 : n])
        tokens.append(extra)
    assert drafters[1]._states[0].rows == 0 and drafters[1]._states[0].pending.rows == len(tokens) - 1
    early, late = (d.propose(0, tokens, Budget(3, 8)) for d in drafters)
    assert torch.equal(early.tokens, late.tokens) and torch.equal(early.parents, late.parents)
    assert drafters[0]._states[0].rows == drafters[1]._states[0].rows == len(tokens) - 1


def test_a_sequences_first_proposal_is_not_timed_for_the_controller(setup):
    """The first proposal writes the prompt's rows (a one-off): the controller's draft-time fit
    sees every later proposal of each request and not the first."""
    folder, target, head = setup
    spec = Speculator.build(SpecOptions(f"eagle3:{head}", "chain", "fixed:3"), target, folder)
    timed, calls = [], []
    spec.controller.observe_draft_time = lambda seconds, depth: timed.append(depth)
    propose = spec.drafter.propose_batch
    spec.drafter.propose_batch = lambda *a: calls.append(1) or propose(*a)
    for prompt in PROMPTS:  # one request at a time: a proposal is one sequence's
        before = len(calls)
        generate_ids(target, [Request(list(prompt), 12)], set(), speculation=spec)
        assert len(calls) - before >= 2
    assert len(timed) == len(calls) - len(PROMPTS)
