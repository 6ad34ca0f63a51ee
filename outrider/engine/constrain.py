"""A round's grammar step: what each request's grammar makes of its proposed tree (spec/grammar.py).

A request with a grammar that drafts grammar-aware (`Request.grammar_drafting`, where it drafts
at all) has its forced tokens proposed as a chain when they are at least as many as the drafts
(certain tokens beat as many guesses), and its tree pruned at forbidden tokens where the verifier
allows it (greedy, or a tree without draft_probs: the walk); every request with a grammar gets
the tokens its grammar allows at each node (`seq.allowed`, [tree size, V] bool), which the round
applies to the target's logits.
"""

from __future__ import annotations

from ..models.kv_cache import KVCache
from ..spec.grammar import GrammarError, forced_chain
from ..spec.types import DraftTree
from .sequence import Sequence


def constrain(seqs: list[Sequence], trees: list[DraftTree], failed: dict[int, str], cache: KVCache,
              max_tree_size: int, vocab: int) -> tuple[list[DraftTree], dict[int, str]]:
    """trees[b] as seqs[b]'s grammar makes it (sequences in `failed` left as they are), and the
    sequences whose grammar failed (batch index -> why). max_tree_size: the most nodes a tree may
    hold this round (the root's included; the engine's headroom). Sets each grammar request's
    `allowed` for this round."""
    trees, errors = list(trees), {}
    for b, seq in enumerate(seqs):
        if seq.grammar is None or b in failed:
            continue
        tree, aware = trees[b], seq.speculate and seq.request.grammar_drafting
        try:
            limit = min(max_tree_size - 1, cache.free_rows(seq.slot) - 1)  # drafts: the root excluded
            forced = seq.grammar.forced(limit) if aware else []
            if forced and len(forced) >= tree.size - 1:
                tree = forced_chain(seq.tokens[-1], forced, vocab, with_probs=tree.draft_probs is not None)
            prune = aware and (tree.draft_probs is None or seq.params.greedy)
            trees[b], seq.allowed = seq.grammar.constrain(tree, prune)
        except GrammarError as err:
            errors[b] = str(err)
    return trees, errors
