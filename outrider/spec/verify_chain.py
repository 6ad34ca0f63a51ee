"""Speculative sampling on a chain, and the primitives every sampling verifier shares.

Vocabulary. At node i the target's distribution over the next token is
`p = target_probs(target_logits[i], params)` (temperature, top-k and top-p applied). The drafter
drew the child of node i from `q = draft_probs[i]`. A draft x is **accepted** with probability
`min(1, p(x) / q(x))`; after a rejection the **recovered** token is drawn from the **residual**
`norm(max(p - q, 0))` and the round stops; when every draft is accepted the **bonus** is drawn
from p at the last node. Each committed token then has law

    q(y) min(1, p(y)/q(y)) + P(reject) norm(max(p - q, 0))(y) = min(p, q)(y) + max(p - q, 0)(y) = p(y)

because P(reject) = sum_x max(q - p, 0)(x) = sum_x max(p - q, 0)(x) when p and q both sum to 1.

All arithmetic is float64 on renormalised rows, so the law is exact up to float64 rounding
(the tests compare it with p to 1e-9).
"""

from __future__ import annotations

import torch

from ..sampling import SamplingParams, warp_probs
from .random import Random
from .types import DraftTree, VerifyResult


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The target distribution p: logits [..., vocab] -> [..., vocab] float64, rows sum to 1."""
    p = warp_probs(logits, params).double()
    return p / p.sum(-1, keepdim=True)


def draft_distribution(draft_probs: torch.Tensor) -> torch.Tensor:
    """The drafter's q: draft_probs [..., vocab] -> [..., vocab] float64, rows sum to 1."""
    q = draft_probs.double()
    return q / q.sum(-1, keepdim=True)


def accept_probability(p: torch.Tensor, q: torch.Tensor, x: int) -> float:
    """min(1, p(x) / q(x)) for a draft x drawn from q. p, q: [vocab].

    q(x) == 0 cannot happen when x was really drawn from q; if it does, we take the limit
    q(x) -> 0 (accept when p(x) > 0). A token outside p's support (p(x) == 0, for example cut
    by top-k or top-p) is never accepted.
    """
    px, qx = float(p[x]), float(q[x])
    if qx > 0.0:
        return min(1.0, px / qx)
    return 1.0 if px > 0.0 else 0.0


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(p - q, 0)), row by row. p, q: [..., vocab] -> [..., vocab].

    A row with p <= q everywhere has no positive part. When p and q both sum to 1 that means
    p == q, every draft is accepted with probability 1, and the row is never drawn from; in
    floating point a rejection may still happen with probability ~1e-16, and then we draw from p
    itself, which is the right law for that branch anyway (the residual of p against itself is
    undefined, and p is what the position must follow).
    """
    positive = (p - q).clamp(min=0.0)
    mass = positive.sum(-1, keepdim=True)
    return torch.where(mass > 0.0, positive / torch.where(mass > 0.0, mass, 1.0), p)


def verify_chain_reference(
    tree: DraftTree, target_logits: torch.Tensor, params: SamplingParams, rng: Random
) -> VerifyResult:
    """Chain rejection sampling, one node at a time (the slow, obviously correct form).

    target_logits: [n, vocab]; tree.draft_probs: [n, vocab] (row n-1, after the last draft, unused).
    """
    tokens = tree.tokens.tolist()
    k = len(tokens) - 1
    p = target_probs(target_logits, params)  # [n, vocab]
    q = _chain_q(tree, k).to(p.device) if k else None  # [k, vocab]; a root alone needs no q
    for i in range(k):
        x = tokens[i + 1]
        if not rng.uniform_below(accept_probability(p[i], q[i], x), offset=i):
            recovered = rng.categorical(residual(p[i], q[i]), offset=i)
            return VerifyResult(list(range(1, i + 1)), tokens[1 : i + 1] + [recovered])
    bonus = rng.categorical(p[k], offset=k)
    return VerifyResult(list(range(1, k + 1)), tokens[1:] + [bonus])


def verify_chain(
    tree: DraftTree, target_logits: torch.Tensor, params: SamplingParams, rng: Random
) -> VerifyResult:
    """Chain rejection sampling, vectorized: no Python loop over nodes, one host sync.

    target_logits: [n, vocab]; tree.draft_probs: [n, vocab] (row n-1 unused).

    Worked example, k = 3 drafts (n = 4 nodes); row i of p and q is about node i+1's token:

        node             0     1     2     3
        token            r     a     b     c
        accepted               T     F     T      uniform_below_rows(min(1, p_i(x)/q_i(x)))
        cumprod                1     0     0      -> num_accepted = 1 (c is never looked at)
        final rows       res0  res1  res2  p3     res_i = norm(max(p_i - q_i, 0)); p3 for the bonus
        drawn from row   num_accepted = 1: the recovered token y ~ res1
        committed        [a, y]
    """
    k = tree.size - 1
    p = target_probs(target_logits, params)  # [n, vocab]
    if k == 0:
        return VerifyResult([], rng.categorical_rows(p, torch.zeros(1, dtype=torch.long, device=p.device)).tolist())
    q = _chain_q(tree, k).to(p.device)  # [k, vocab]
    drafts = tree.tokens[1:].to(p.device)  # [k]
    px = p[:k].gather(1, drafts[:, None])[:, 0]  # [k]
    qx = q.gather(1, drafts[:, None])[:, 0]  # [k]
    limit = (px > 0).to(p.dtype)  # q(x) == 0: see accept_probability
    accept = torch.where(qx > 0, px / torch.where(qx > 0, qx, 1.0), limit).clamp(max=1.0)  # [k]
    accepted = rng.uniform_below_rows(accept, torch.arange(k, device=p.device))  # [k] bool; row i decides offset i
    num_accepted = accepted.long().cumprod(0).sum()  # [] drafts before the first rejection
    final_rows = torch.cat([residual(p[:k], q), p[k:]])  # [n, vocab]
    last = rng.categorical_rows(final_rows.index_select(0, num_accepted.view(1)), num_accepted.view(1))  # [1]
    host = torch.cat([num_accepted.view(1), last.view(1), drafts]).tolist()  # the one sync
    a = host[0]
    return VerifyResult(list(range(1, a + 1)), host[2 : 2 + a] + [host[1]])


def _chain_q(tree: DraftTree, k: int) -> torch.Tensor:
    """Rows 0..k-1 of the tree's draft_probs, as q. k >= 1 -> [k, vocab] float64."""
    if tree.draft_probs is None:
        raise ValueError("rejection sampling needs draft_probs (use the tree walk for drafters without them)")
    return draft_distribution(tree.draft_probs[:k])
