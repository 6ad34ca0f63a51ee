"""A round's target side: check the trees, run the one verify forward, verify each tree.

    problems = invalid(trees)                            # a bad tree never reaches the forward
    forward  = Forward.run(target, cache, seqs, trees)   # one forward: logits at the real rows only
    results  = verify(seqs, trees, forward)              # each sequence's verifier (spec/verifiers.py)

`verify` applies each sequence's processing to its rows (logit bias and penalties along each
node's path: spec/processing.py; its grammar's forbidden tokens at -inf: spec/grammar.py), then
reads, in one host transfer for the batch, every real row's argmax and whether its raw logits
are finite. A greedy sequence's registered verifier (`GreedyVerifier`: greedy_chain,
greedy_tree) takes its rows' argmax from that read and walks its tree on the host; any other
verifier (sampling) takes its rows' logits and its randomness at the root's next position, and
makes its own host reads. Each row's result depends on its own rows alone (kernels/native.py),
so a sequence whose logits are not finite or whose verifier raises fails alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.batch import pack
from ..models.decoder import Decoder, ForwardOutput
from ..models.expert_select import selected_by, selection_of
from ..models.kv_cache import KVCache
from ..spec.tree import tree_problem
from ..spec.types import DraftTree, VerifyResult
from ..spec.verify_greedy import GreedyVerifier, choices
from .sequence import Sequence

NOT_FINITE = -1  # the choice of a row whose raw logits are not all finite


def invalid(trees: list[DraftTree], among: list[int], vocab: int) -> dict[int, str]:
    """The trees of `among` (batch indices) that are not valid draft trees, with why."""
    problems = {b: tree_problem(trees[b].tokens, trees[b].parents, trees[b].draft_probs, vocab) for b in among}
    return {b: f"the drafter proposed an invalid draft tree: {problem} (a bug in the drafter; nothing was committed)"
            for b, problem in problems.items() if problem}


@dataclass
class Forward:
    """The round's verify forward over the trees of `order` (batch indices, in forward order):
    `out.logits` [sum of their sizes, vocab] holds their real rows, slot by slot (rows[b]);
    lengths[b]: b's cache length before the round, the root's row."""

    order: list[int]
    rows: dict[int, slice]
    lengths: dict[int, int]
    out: ForwardOutput | None  # None: no tree to verify (no forward ran)

    @staticmethod
    def run(target: Decoder, cache: KVCache, seqs: list[Sequence], trees: list[DraftTree], order: list[int],
            hidden_layers: tuple[int, ...] = (), attention: bool = False) -> "Forward":
        """One forward over trees[b] for b in `order`, tapping `hidden_layers`; `attention`: ask for
        the scores too (a drafter reads them; Decoder.forward(attention=))."""
        lengths = {b: cache.lengths[seqs[b].slot] for b in order}
        rows, offset = {}, 0
        for b in order:
            rows[b] = slice(offset, offset + trees[b].size)
            offset += trees[b].size
        if not order:
            return Forward(order, rows, lengths, None)
        batch = pack([seqs[b].slot for b in order], [lengths[b] for b in order], [trees[b].tokens for b in order],
                     [trees[b].parents for b in order], logits="real", hidden_layers=hidden_layers,
                     scratch_row=cache.scratch_row, device=target.device)
        asked = {"attention": True} if attention else {}  # the scores only where a drafter reads them
        selection = selection_of([seqs[b].verify for b in order])  # a LOSSY expert selection, named only
        if selection is not None:
            out = selection.verify_forward(target, batch, cache, [trees[b] for b in order],
                                           selected_by([seqs[b].verify for b in order], selection), **asked)
            return Forward(order, rows, lengths, out)
        return Forward(order, rows, lengths, target.forward(batch, cache, **asked))

    def hidden(self, b: int, path: list[int]) -> dict[int, torch.Tensor]:
        """b's taps at the nodes of `path`: layer -> [len(path), E]."""
        i = self.order.index(b)
        return {layer: h[i, path] for layer, h in self.out.hidden.items()}

    def attention(self, b: int) -> torch.Tensor | None:
        """b's scores over its verified rows [layers, G, kv_len], or None (not asked, or not the native layer)."""
        scores = self.out.attention
        return None if scores is None else scores[self.order.index(b)]


def verify(seqs: list[Sequence], trees: list[DraftTree], forward: Forward
           ) -> tuple[dict[int, VerifyResult], dict[int, str]]:
    """Each verified sequence's result by its own verifier (batch index -> VerifyResult), and the
    sequences that failed: logits not finite, or a verifier that raised (batch index -> why)."""
    results, failed = {}, {}
    if not forward.order:
        return results, failed
    raw = forward.out.logits  # [sum of tree sizes, vocab]
    logits = _processed(raw, [seqs[b] for b in forward.order], [trees[b] for b in forward.order])
    finite = torch.isfinite(raw.sum(-1))  # [sum of tree sizes]: NaN or inf anywhere in a raw row
    host = torch.where(finite, choices(logits), NOT_FINITE).tolist()  # the round's one host read
    for b in forward.order:
        seq, tree, rows = seqs[b], trees[b], forward.rows[b]
        if NOT_FINITE in host[rows]:
            failed[b] = "the target's logits are not finite (NaN or inf) for this request"
            continue
        try:
            if isinstance(seq.verify, GreedyVerifier):
                results[b] = seq.verify.from_choices(tree, host[rows])
            else:
                rng = seq.rng.at(len(seq.tokens))  # offset 0: the position of the root's next token
                results[b] = seq.verify(tree, logits[rows], seq.params, rng)
        except Exception as err:  # a verifier's bug: this request fails, the others go on
            failed[b] = f"verification failed: {type(err).__name__}: {err}"
    return results, failed


def _processed(logits: torch.Tensor, seqs: list[Sequence], trees: list[DraftTree]) -> torch.Tensor:
    """The logits [sum of tree sizes, vocab] with each sequence's bias and penalties applied along
    its nodes' paths (spec/processing.py) and its grammar's forbidden tokens at -inf
    (spec/grammar.py); the same tensor when no sequence has either."""
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
