"""One speculative round for a batch of slots: draft, verify in one target forward, commit.

    trees   = propose(batch)                                    # one drafter call; root-only without one
    out     = target.forward(pack(trees), cache)                # logits at every node
    result  = verify(tree, logits, sampling, rng)               # exact
    cache   : compact the accepted path, set the new length     # rollback is the length
    drafter.update_batch(results, hidden on the accepted paths) # the caller's: drafter follows the commit

Invariant between rounds: `cache.lengths[slot] == len(seq.tokens) - 1` (the root, the last
committed token, is not in the cache yet: this round's forward writes it).
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from ..models.batch import pack
from ..models.decoder import Decoder
from ..models.kv_cache import KVCache
from ..spec.tree import depths, tree_problem
from ..spec.types import DraftTree, RoundStats, VerifyResult
from ..spec.verify_greedy import verify_greedy_chain, verify_greedy_tree, walk
from .sequence import Sequence

# Greedy verifiers whose choice per node is the target's argmax: a round reads every such slot's
# choices in one host transfer (one sync per round on a GPU) and walks them on the host.
ARGMAX_VERIFIERS = (verify_greedy_chain, verify_greedy_tree)

Proposer = Callable[[list[Sequence]], list[DraftTree]]  # one tree per sequence, one call per round


class DraftError(RuntimeError):
    """A drafter broke the draft-tree contract (spec/types.py): a bug, refused before the forward."""


def run_round(
    target: Decoder,
    cache: KVCache,
    seqs: list[Sequence],
    propose: Proposer,
    hidden_layers: tuple[int, ...] = (),
) -> tuple[list[VerifyResult], list[dict[int, torch.Tensor]]]:
    """Advance every sequence by one round; returns each one's result and its tapped hidden
    states on the accepted path: hidden[b][layer] is [1 + num_accepted, E], the rows of the root
    and the accepted nodes (the features of the tokens at positions cache_len .. cache_len + a)."""
    start = time.perf_counter()
    trees = propose(seqs)
    vocab = target.config.vocab_size
    for seq, tree in zip(seqs, trees):
        problem = tree_problem(tree.tokens, tree.parents, tree.draft_probs, vocab)
        if problem:
            raise DraftError(f"the drafter proposed an invalid draft tree for sequence {seq.seq_id}: {problem} "
                             "(a bug in the drafter; nothing was committed this round)")
    drafted = time.perf_counter()
    lens = [cache.lengths[seq.slot] for seq in seqs]
    batch = pack(
        [seq.slot for seq in seqs], lens, [t.tokens for t in trees], [t.parents for t in trees],
        logits="real", hidden_layers=hidden_layers, scratch_row=cache.scratch_row, device=target.device,
    )
    out = target.forward(batch, cache)  # logits [sum of tree sizes, vocab]: real rows only, slot by slot
    argmax = [seq.verify in ARGMAX_VERIFIERS for seq in seqs]
    choices = out.logits.argmax(-1).tolist() if any(argmax) else None  # [sum of tree sizes]: one sync
    results, hidden, offset = [], [], 0
    for b, (seq, tree, length) in enumerate(zip(seqs, trees, lens)):
        if argmax[b]:
            result = walk(tree.tokens.tolist(), tree.parents.tolist(), choices[offset : offset + tree.size])
        else:
            rng = seq.rng.at(len(seq.tokens))  # offset 0: the position of the root's next token
            result = seq.verify(tree, out.logits[offset : offset + tree.size], seq.params, rng)
        offset += tree.size
        path = [0, *result.accepted_nodes]
        hidden.append({layer: h[b, path] for layer, h in out.hidden.items()})  # [len(path), E] each
        cache.compact(seq.slot, [length + node for node in path], length)
        cache.set_length(seq.slot, length + len(path))
        seq.tokens.extend(result.tokens)
        _count(seq.stats, tree, result)
        results.append(result)
    verified = time.perf_counter()
    share = 1.0 / len(seqs)
    for seq in seqs:
        seq.stats.draft_s += (drafted - start) * share
        seq.stats.verify_s += (verified - drafted) * share
    return results, hidden


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
