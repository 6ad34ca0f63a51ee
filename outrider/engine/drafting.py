"""The drafter's and the controller's side of a round: propose for the batch, observe its outcome.

    propose   budgets = controller.budgets(...)           depth and nodes per drafting sequence
              trees   = drafter.propose_batch(...)         one call for the batch
              controller.observe_draft_time(...); trees = controller.trim(...)
    observe   controller.observe(seq, tree, result)        per sequence
              drafter.observe_attention(...)               where it declares needs_attention
              drafter.update_batch(...)                    the drafter follows the commit

Faults stay with their sequence: when the batched proposal raises, each sequence is asked alone,
so the sequences reported failed are those whose own proposal raises (they get the root alone);
when an update raises, the drafter's `SequenceFaults` names the sequences it concerns (the
per-sequence default, drafters/base.py), and any other exception fails every sequence of the call
(what a batched update did is unknown). The controller and the drafter are called directly:
every hook is declared in drafters/base.py and control/base.py, with defaults.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from ..drafters.base import SequenceFaults
from ..models.kv_cache import KVCache
from ..spec.types import Budget, DraftTree, VerifyResult
from .sequence import Sequence
from .speculator import Speculator


def propose(spec: Speculator | None, cache: KVCache, seqs: list[Sequence]) -> tuple[list[DraftTree], dict[int, str]]:
    """A tree per sequence (the root alone where it does not draft, its budget is 0 or its
    proposal raised) from one drafter call, and the sequences whose proposal raised (batch index
    -> why). A drafting sequence may write the K/V rows its slot has free, and no more than its
    request's max_draft_tokens; the controller's budgets see the round's whole batch size."""
    trees = [DraftTree.root_only(seq.tokens[-1]) for seq in seqs]
    drafting = [b for b, seq in enumerate(seqs) if seq.speculate]  # none when there is no drafter
    if not drafting:
        return trees, {}
    budgets = spec.controller.budgets([seqs[b].seq_id for b in drafting], len(seqs), spec.nodes_for)
    todo: list[tuple[int, Budget]] = []
    for b, budget in zip(drafting, budgets):
        nodes = min(spec.nodes_for(budget.depth), _free_rows(cache, seqs[b]) - 1)
        if budget.depth >= 1 and nodes >= 1:
            todo.append((b, replace(budget, nodes=nodes)))
    if not todo:
        return trees, {}
    start = time.perf_counter()
    drafted, raised = _drafted(spec, [seqs[b] for b, _ in todo], [budget for _, budget in todo])
    # one sequence's share of the proposal (the controller weighs it against one sequence's
    # verify cost), and its depth; not where a sequence had its first (its prompt's rows
    # written: 20 ms where a round's drafts take 1-3, SmolLM2's head)
    first = [b for b, _ in todo if not seqs[b].proposed]
    if not first:
        spec.controller.observe_draft_time((time.perf_counter() - start) / len(todo), max(bu.depth for _, bu in todo))
    for b, _ in todo:
        seqs[b].proposed = True
    drafted = spec.controller.trim([seqs[b].seq_id for b, _ in todo], drafted, len(seqs))  # may keep fewer
    for (b, _), tree in zip(todo, drafted):
        trees[b] = tree
    return trees, {todo[i][0]: why("the drafter failed to propose", err) for i, err in raised.items()}


def _free_rows(cache: KVCache, seq: Sequence) -> int:
    """The K/V rows `seq` may write this round, the root's included."""
    rows, cap = cache.free_rows(seq.slot), seq.request.max_draft_tokens
    return rows if cap is None else min(rows, cap + 1)


def _drafted(spec: Speculator, seqs: list[Sequence], budgets: list[Budget]
             ) -> tuple[list[DraftTree], dict[int, Exception]]:
    """The drafter's trees, from one call; when that raises, from one call per sequence, with the
    sequences whose own call raised (index -> exception; they get the root alone)."""
    drafter = spec.drafter
    try:
        return drafter.propose_batch([s.seq_id for s in seqs], [s.tokens for s in seqs], budgets), {}
    except Exception:
        trees, raised = [], {}
        for i, (seq, budget) in enumerate(zip(seqs, budgets)):
            try:
                trees += drafter.propose_batch([seq.seq_id], [seq.tokens], [budget])
            except Exception as err:  # noqa: PERF203  (a fault of this sequence's drafter state)
                raised[i] = err
                trees.append(DraftTree.root_only(seq.tokens[-1]))
        return trees, raised


def observe(spec: Speculator, seqs: list[Sequence], trees: list[DraftTree], results: list[VerifyResult],
            hidden: list[dict[int, torch.Tensor]], attention: list[torch.Tensor | None],
            follow: list[bool] | None = None) -> dict[int, str]:
    """The drafting sequences' round, seen by the controller, then followed by the drafter.
    trees[i]: the tree verified for seqs[i] (the drafter's, or what a grammar made of it);
    results[i] its result; hidden[i]: the taps on the accepted path (layer -> [1 + num_accepted,
    E]), given to the drafter stacked in its declared order ([1 + num_accepted, layers, E]) or
    None; attention[i]: the verify forward's scores [layers, G, kv_len] or None, for a drafter
    that declares needs_attention; follow[i] (default all): whether the drafter follows seqs[i]
    (False: it proposed nothing and catches up from the tokens at its next proposal, capability
    catches_up). Returns the sequences whose drafter state broke (index -> why)."""
    for seq, tree, result in zip(seqs, trees, results):
        spec.controller.observe(seq.seq_id, tree, result)
    at = [i for i in range(len(seqs)) if follow is None or follow[i]]  # the sequences the drafter follows
    if not at:
        return {}
    ids = [seqs[i].seq_id for i in at]
    try:
        if spec.attention:
            spec.drafter.observe_attention(ids, [attention[i] for i in at])
        spec.drafter.update_batch(ids, [results[i] for i in at],
                                  [spec.stacked(hidden[i]) if spec.hidden_layers else None for i in at])
    except SequenceFaults as faults:
        return {at[i]: why("the drafter failed to follow the commit", err) for i, err in faults.faults.items()}
    except Exception as err:
        return {i: why("the drafter failed to follow the commit", err) for i in at}
    return {}


def why(what: str, err: Exception) -> str:
    return f"{what}: {type(err).__name__}: {err}"
