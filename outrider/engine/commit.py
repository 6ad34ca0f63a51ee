"""A round's commit: what each verified sequence keeps of its tree.

The slot state keeps the accepted path: its rows are moved to the positions after the committed
prefix (`compact`) and the length set past them (`set_length`), so a rejected draft is rolled
back by not advancing the length (models/state.py). The sequence's record then gets the committed
tokens, their logprobs when asked, its processor and grammar follow them, and its counters
(`RoundStats`) count the round.
"""

from __future__ import annotations

import torch

from ..models.kv_cache import KVCache
from ..spec.grammar import GrammarError
from ..spec.tree import depths
from ..spec.types import DraftTree, RoundStats, VerifyResult
from .request import TokenLogprob
from .sequence import Sequence
from .verify import Forward


def commit(cache: KVCache, seqs: list[Sequence], trees: list[DraftTree], results: dict[int, VerifyResult],
           forward: Forward) -> dict[int, str]:
    """Commit results[b] for seqs[b] (batch index b); returns the sequences whose grammar refused
    what was committed (batch index -> why: it fails alone, its round committed and counted)."""
    failed = {}
    for b, result in results.items():
        seq, tree, length = seqs[b], trees[b], forward.lengths[b]
        path = [0, *result.accepted_nodes]  # the root and the accepted nodes, root to leaf
        cache.compact(seq.slot, [length + node for node in path], length)
        cache.set_length(seq.slot, length + len(path))
        if seq.logprobs is not None:
            rows = forward.out.logits[forward.rows[b]]  # [tree size, vocab]: the raw logits
            seq.logprobs.extend(token_logprobs(rows[path], result.tokens, seq.request.logprobs))
        seq.tokens.extend(result.tokens)
        if seq.processor is not None:
            seq.processor.commit(result.tokens)
        if seq.grammar is not None:
            seq.allowed = None
            try:
                seq.grammar.commit(result.tokens)
            except GrammarError as err:  # the request's grammar broke: it fails alone
                failed[b] = str(err)
        count(seq.stats, tree, result)
    return failed


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


def count(stats: RoundStats, tree: DraftTree, result: VerifyResult) -> None:
    """Add one round of `tree` verified to `result` to the sequence's counters."""
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
