"""Multi-draft recursive rejection sampling (RRS; SpecTr, SpecInfer, the EAGLE codebases).

The children of node i, in index order, are **siblings** the drafter drew from q = draft_probs[i],
in that order, in one of two **modes** (the tree does not record it; the verifier is built for one):

- with replacement: the siblings are i.i.d. draws from q;
- without replacement: sibling j was drawn from q with siblings 1..j-1 removed and renormalised.

At the current node, with p the target's distribution there, try the siblings in order:

    accept sibling x with probability min(1, p(x) / q(x))      -> move to it, repeat at that node
    on rejection   p <- norm(max(p - q, 0))                     (the residual, verify_chain.py)
                   q <- q                                       (with replacement)
                   q <- q with x removed, renormalised          (without replacement)
    all rejected, or no children: commit y ~ p and stop

Why it is exact, by induction on the number of siblings left: if the remaining siblings are
drawn (in the node's mode) from the current q, the token committed at this position has law p.
No sibling left: y ~ p. Otherwise the first one gives min(p, q) on acceptance; on rejection the
rest produce norm(max(p - q, 0)) (the hypothesis, whatever x was rejected, because the next
sibling is drawn from the updated q), with total mass P(reject) = sum max(p - q, 0); the sum is p.
An accepted sibling's subtree then repeats the argument one position further.

Degenerate cases. p <= q everywhere means p == q: acceptance is certain and the residual never
drawn from (verify_chain.residual falls back to p for rounding). A sibling with q(x) == 0 cannot
have been drawn from q; verify_chain.accept_probability takes the limit. Tokens cut by top-k or
top-p have p(x) == 0: never accepted, never in a residual, never drawn.
"""

from __future__ import annotations

import torch

from ..sampling import SamplingParams
from .random import Random
from .types import DraftTree, VerifyResult
from .verify_chain import accept_probability, draft_distribution, residual, target_probs
from .tree import children


class MultiDraftVerifier:
    """verify(tree, target_logits [n, vocab], params, rng) -> VerifyResult for siblings drawn
    with replacement (`without_replacement=False`) or without."""

    def __init__(self, without_replacement: bool) -> None:
        self.without_replacement = without_replacement

    def __call__(
        self, tree: DraftTree, target_logits: torch.Tensor, params: SamplingParams, rng: Random
    ) -> VerifyResult:
        tokens = tree.tokens.tolist()
        kids = children(tree.parents.tolist())
        node, accepted = 0, []
        while True:  # the token after `node` sits at offset len(accepted) (its depth)
            p = target_probs(target_logits[node], params)  # [vocab]
            child, p = self._try_siblings(tree, node, kids[node], tokens, p, rng, len(accepted))
            if child is None:
                return VerifyResult(accepted, [tokens[i] for i in accepted] + [rng.categorical(p, offset=len(accepted))])
            accepted.append(child)
            node = child

    def _try_siblings(
        self, tree: DraftTree, node: int, siblings: list[int], tokens: list[int], p: torch.Tensor, rng: Random,
        offset: int,
    ) -> tuple[int | None, torch.Tensor]:
        """(the accepted sibling, p) or, all rejected, (None, the final residual). p: [vocab]."""
        if not siblings:
            return None, p
        if tree.draft_probs is None:
            raise ValueError("multi-draft rejection sampling needs draft_probs (use the tree walk without them)")
        q = draft_distribution(tree.draft_probs[node]).to(p.device)  # [vocab]
        for j, child in enumerate(siblings):  # sibling j's test has its own draw at this offset
            x = tokens[child]
            if rng.uniform_below(accept_probability(p, q, x), offset=offset, index=j):
                return child, p
            q_next = _without(q, x) if self.without_replacement else q
            p, q = self._residual(p, q, q_next), q_next
        return None, p

    def _residual(self, p: torch.Tensor, q: torch.Tensor, q_next: torch.Tensor) -> torch.Tensor:
        """What the remaining siblings (drawn from q_next) must produce after a rejection of a draw
        from q: norm(max(p - q, 0)), the choice that keeps the position's law p
        (spec/verify_resispec.py reshapes it, lossy). All [vocab]."""
        return residual(p, q)


def _without(q: torch.Tensor, x: int) -> torch.Tensor:
    """q with token x removed and renormalised. q: [vocab]. All zeros if q was all on x."""
    q = q.clone()
    q[x] = 0.0
    mass = float(q.sum())
    return q / mass if mass > 0.0 else q
