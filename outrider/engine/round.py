"""One speculative round for a batch of slots: verify the drafted trees in one target forward, commit.

    trees   = propose(batch)                                    # the loop's: one drafter call
    out     = target.forward(pack(trees), cache)                # logits at every node
    logits  = process(out.logits)                               # bias, penalties along each path
    result  = verify(tree, logits, sampling, rng)               # exact
    cache   : compact the accepted path, set the new length     # rollback is the length
    drafter.update_batch(results, hidden on the accepted paths) # the loop's: drafter follows the commit

Invariant between rounds: `cache.lengths[slot] == len(seq.tokens) - 1` (the root, the last
committed token, is not in the cache yet: this round's forward writes it).

Faults stay with their sequence: an invalid tree is left out of the forward, and non-finite
logits or a verifier that raises fail that sequence alone (`Outcome.failed`), before anything
of it is committed; the others commit as if it had not been there (each row's result never
depends on the other rows: kernels/native.py). An exception in the forward itself is not a
sequence's: it propagates.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..models.batch import pack
from ..models.decoder import Decoder
from ..models.kv_cache import KVCache
from ..spec.grammar import GrammarError
from ..spec.tree import depths, tree_problem
from ..spec.types import DraftTree, RoundStats, VerifyResult
from ..spec.verify_greedy import verify_greedy_chain, verify_greedy_tree, walk
from .request import TokenLogprob
from .sequence import Sequence

# Greedy verifiers whose choice per node is the target's argmax: a round reads every such slot's
# choices in one host transfer (one sync per round on a GPU) and walks them on the host.
ARGMAX_VERIFIERS = (verify_greedy_chain, verify_greedy_tree)
NOT_FINITE = -1  # the choice of a row whose raw logits are not all finite


@dataclass
class Outcome:
    """What a round did: results[b] (None where sequence b failed), hidden[b] its taps on the
    accepted path (layer -> [1 + num_accepted, E]), failed[b] why it failed; attention[b], when
    asked, the verify forward's scores over all of b's verified rows ([layers, G, kv_len], None
    where the forward does not give them: Decoder.forward(attention=))."""

    results: list[VerifyResult | None]
    hidden: list[dict[int, torch.Tensor]]
    failed: dict[int, str] = field(default_factory=dict)
    attention: list[torch.Tensor | None] = field(default_factory=list)


def run_round(
    target: Decoder,
    cache: KVCache,
    seqs: list[Sequence],
    trees: list[DraftTree],
    hidden_layers: tuple[int, ...] = (),
    draft_s: float = 0.0,
    attention: bool = False,
) -> Outcome:
    """Verify trees[b] for seqs[b] and commit; `draft_s`, the proposal's time, is shared out
    among the sequences' stats. hidden[b][layer] holds the rows of the root and the accepted
    nodes (the features of the tokens at positions cache_len .. cache_len + a)."""
    start = time.perf_counter()
    outcome = Outcome([None] * len(seqs), [{} for _ in seqs], attention=[None] * len(seqs))
    vocab = target.config.vocab_size
    for b, (seq, tree) in enumerate(zip(seqs, trees)):
        problem = tree_problem(tree.tokens, tree.parents, tree.draft_probs, vocab)
        if problem:
            outcome.failed[b] = (f"the drafter proposed an invalid draft tree: {problem} (a bug in the "
                                 "drafter; nothing was committed)")
    live = [b for b in range(len(seqs)) if b not in outcome.failed]
    if live:
        _verify(target, cache, [seqs[b] for b in live], [trees[b] for b in live], hidden_layers, outcome, live,
                attention)
    verified = time.perf_counter()
    share = 1.0 / max(len(seqs), 1)
    for seq in seqs:
        seq.stats.draft_s += draft_s * share
        seq.stats.verify_s += (verified - start) * share
    return outcome


def _verify(target, cache, seqs, trees, hidden_layers, outcome: Outcome, index: list[int],
            attention: bool = False) -> None:
    lens = [cache.lengths[seq.slot] for seq in seqs]
    batch = pack(
        [seq.slot for seq in seqs], lens, [t.tokens for t in trees], [t.parents for t in trees],
        logits="real", hidden_layers=hidden_layers, scratch_row=cache.scratch_row, device=target.device,
    )
    asked = {"attention": True} if attention else {}  # the scores only where a drafter reads them
    out = target.forward(batch, cache, **asked)  # logits [sum of tree sizes, vocab]: real rows only, slot by slot
    attention_out = getattr(out, "attention", None)
    logits = _processed(out.logits, seqs, trees)  # [sum of tree sizes, vocab]
    finite = torch.isfinite(out.logits.sum(-1))  # [sum of tree sizes]: NaN or inf anywhere in a row
    choices = torch.where(finite, logits.argmax(-1), NOT_FINITE).tolist()  # one sync for the batch
    offset = 0
    for i, (b, seq, tree, length) in enumerate(zip(index, seqs, trees, lens)):
        rows = slice(offset, offset + tree.size)
        offset += tree.size
        if NOT_FINITE in choices[rows]:
            outcome.failed[b] = "the target's logits are not finite (NaN or inf) for this request"
            continue
        try:
            if seq.verify in ARGMAX_VERIFIERS:
                result = walk(tree.tokens.tolist(), tree.parents.tolist(), choices[rows])
            else:
                rng = seq.rng.at(len(seq.tokens))  # offset 0: the position of the root's next token
                result = seq.verify(tree, logits[rows], seq.params, rng)
        except Exception as err:  # a verifier's bug: this request fails, the others go on
            outcome.failed[b] = f"verification failed: {type(err).__name__}: {err}"
            continue
        path = [0, *result.accepted_nodes]
        if attention_out is not None:
            outcome.attention[b] = attention_out[i]  # [layers, G, kv_len]: every verified row of b's
        outcome.hidden[b] = {layer: h[i, path] for layer, h in out.hidden.items()}  # [len(path), E] each
        cache.compact(seq.slot, [length + node for node in path], length)
        cache.set_length(seq.slot, length + len(path))
        if seq.logprobs is not None:
            seq.logprobs.extend(token_logprobs(out.logits[rows][path], result.tokens, seq.request.logprobs))
        seq.tokens.extend(result.tokens)
        if seq.processor is not None:
            seq.processor.commit(result.tokens)
        if seq.grammar is not None:
            seq.allowed = None
            try:
                seq.grammar.commit(result.tokens)
            except GrammarError as err:  # the request's grammar broke: it fails alone
                outcome.failed[b] = str(err)
        _count(seq.stats, tree, result)
        outcome.results[b] = result


def _processed(logits: torch.Tensor, seqs: list[Sequence], trees: list[DraftTree]) -> torch.Tensor:
    """The logits with each sequence's bias and penalties applied along its nodes' paths
    (spec/processing.py) and its grammar's forbidden tokens at -inf (spec/grammar.py); the same
    tensor when no sequence has either."""
    if all(seq.processor is None and seq.allowed is None for seq in seqs):
        return logits
    logits = logits.clone()
    offset = 0
    for seq, tree in zip(seqs, trees):
        rows = slice(offset, offset + tree.size)
        if seq.processor is not None:
            logits[rows] = seq.processor.apply(logits[rows], tree.tokens, tree.parents).to(logits.dtype)
        if seq.allowed is not None:
            logits[rows] = logits[rows].masked_fill(~seq.allowed.to(logits.device), float("-inf"))
        offset += tree.size
    return logits


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """logits [k, V] at the rows that chose tokens[0..k-1] -> each token's log-probability under
    the target's raw distribution, with the `top` likeliest tokens of its row."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [k, V]
    chosen = logp.gather(1, torch.tensor(tokens, device=logp.device).view(-1, 1)).view(-1).tolist()
    if top:
        values, ids = logp.topk(top, dim=-1)  # [k, top]
        best = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        best = [()] * len(tokens)
    return [TokenLogprob(t, lp, b) for t, lp, b in zip(tokens, chosen, best)]


def _count(stats: RoundStats, tree: DraftTree, result: VerifyResult) -> None:
    stats.rounds += 1
    stats.committed += len(result.tokens)
    stats.committed_by_round.append(len(result.tokens))
    stats.drafted += tree.size - 1
    max_depth = int(depths(tree.parents).max()) if tree.size > 1 else 0
    for lst, n in ((stats.accepted_by_position, max_depth), (stats.proposed_by_position, max_depth),
                   (stats.accepted_length_hist, result.num_accepted + 1)):
        lst.extend([0] * (n - len(lst)))
    for d in range(max_depth):
        stats.proposed_by_position[d] += 1
    for d in range(result.num_accepted):
        stats.accepted_by_position[d] += 1
    stats.accepted_length_hist[result.num_accepted] += 1
