"""DBLast's chains and their exact proposal: the posterior-marginalised conditional q.

A mixture block (`MixtureBlock`) holds, for one sequence's block, the mixture weights pi [M] and
each component's logits over the K positions [M, K, Vd] (drafters/dblast_mixture.py). Under the
request's sampling parameters each component's position k has the warped distribution
q_k(. | z) (over the target vocabulary V), and the drafts' joint law is

    q(x_1..x_K) = sum_z pi(z) prod_k q_k(x_k | z)

The chain verifier's rejection sampling is exact when the draft at position i is distributed,
given everything the verifier saw, as the `q` row it is given. The drafts are sampled by
component (draw z ~ pi, then every x_k ~ q_k(. | z)); z is never shown to the verifier, so the
law of x_i given the drafted prefix is the **posterior-marginalised conditional**

    q(x_i | x_<i) = sum_z pi(z | x_<i) q_i(x_i | z),   pi(z | x_<i) ∝ pi(z) prod_{j<i} q_j(x_j | z)

which is the row each draft carries (`draft_probs`). Three chains, each built position by position
with that row (`_chain`):

    by component   sampling (unseeded: rejection sampling): z from the drafter's own stream at
                   offset 0, index COMPONENT; x_k from q_k(. | z) at offset k-1 (index 0)
    coupled        sampling verified by the walk (a seeded request: capabilities.py `couples`):
                   x_i = categorical(q(. | x_<i), u_t) with the walk's own token uniform u_t,
                   which draws the same joint law (chain rule) and agrees with the walk's token
                   whenever q and p put u_t in the same bucket
    greedy         the argmax of q(. | x_<i) (components softmax-ed at temperature 1)

`posterior_log_rows` is the same conditional for given tokens, batched and differentiable (what
training optimises); `posterior_rows_reference` the slow, obviously correct form both are tested
against (explicit Bayes, one position and one component at a time).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..heads.vocab_map import to_target_logits
from ..sampling import SamplingParams, warp_probs
from ..spec.types import DraftTree

COMPONENT = 1  # the index of the component's draw (the drafts' are index 0)


@dataclass
class MixtureBlock:
    """One sequence's mixture block. log_pi: [M]; logits: [M, K, Vd] float32 (draft vocabulary);
    to_target: [Vd] long draft id -> target id, or None (identity); vocab: V, the target's."""

    root: int
    log_pi: torch.Tensor
    logits: torch.Tensor
    vocab: int
    to_target: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return int(self.logits.shape[1])

    def probs(self, params: SamplingParams, depth: int | None = None) -> torch.Tensor:
        """[M, depth or K, V] float64: q_k(. | z) under `params` (greedy: softmax at temperature 1)."""
        keep = None if depth is None else max(depth, 1)
        full = to_target_logits(self.to_target, self.logits[:, :keep].double(), self.vocab)  # [M, depth, V]
        if params.greedy:
            return torch.softmax(full, dim=-1)
        p = warp_probs(full, params)
        return p / p.sum(-1, keepdim=True)

    def pi(self) -> torch.Tensor:
        """[M] float64 mixture weights."""
        return torch.softmax(self.log_pi.double(), dim=-1)


def _chain(block: MixtureBlock, probs: torch.Tensor, depth: int, pick, min_confidence: float, stop) -> DraftTree:
    """Positions 1..depth; pick(d, row) -> the draft at position d+1, row = q(. | drafts so far) [V].
    Cut after the first draft whose path probability falls below `min_confidence` or where
    `stop(entropies so far)` says so (that draft is kept): a cut that depends only on the drafts so
    far leaves every kept draft's law as its row says. The rows ride along as draft_probs."""
    depth = min(depth, block.size)
    if depth < 1:
        return DraftTree.root_only(block.root)
    log_w = block.log_pi.double().log_softmax(-1)  # [M] log pi(z | x_<d), unnormalised after the first step
    drafts, rows, confidence, entropies = [], [], [1.0], []
    for d in range(depth):
        row = torch.softmax(log_w, -1) @ probs[:, d]  # [V] q(. | x_<d)
        x = pick(d, row)
        drafts.append(x)
        rows.append(row)
        confidence.append(confidence[-1] * float(row[x]))
        if stop is not None:
            live = row[row > 0]
            entropies.append(float(-(live * live.log()).sum()))
        log_w = log_w + probs[:, d, x].log()  # components that cannot draw x drop out (-inf)
        if confidence[-1] < min_confidence or (stop is not None and stop(entropies)):
            break
    draft_probs = torch.cat((torch.stack(rows), probs.new_zeros(1, probs.shape[-1])))  # [k + 1, V]
    tree = DraftTree.chain(block.root, drafts, draft_probs)
    return DraftTree(tree.tokens, tree.parents, tree.draft_probs, torch.tensor(confidence))


def sampled_by_component(block: MixtureBlock, depth: int, params: SamplingParams, rng, min_confidence: float = 0.0,
                         stop=None) -> DraftTree:
    """Draw z ~ pi, then each position from its component (rng: the drafter's own streams, already
    `.at(len(committed))`); each draft carries the posterior-marginalised row."""
    probs = block.probs(params, depth)  # [M, depth, V]
    z = rng.categorical(block.pi(), offset=0, index=COMPONENT)
    return _chain(block, probs, depth, lambda d, row: rng.categorical(probs[z, d], offset=d), min_confidence, stop)


def coupled_chain(block: MixtureBlock, depth: int, params: SamplingParams, rng, min_confidence: float = 0.0,
                  stop=None) -> DraftTree:
    """Each draft drawn from its posterior-marginalised row with the walk's token uniform (rng: the
    request's own streams, `.at(len(committed))`): the same joint law as drawing by component."""
    probs = block.probs(params, depth)
    return _chain(block, probs, depth, lambda d, row: rng.categorical(row, offset=d), min_confidence, stop)


def greedy_mixture_chain(block: MixtureBlock, depth: int, min_confidence: float = 0.0, stop=None) -> DraftTree:
    """The argmax of each posterior-marginalised row (the likeliest next draft given the drafts so far)."""
    probs = block.probs(SamplingParams(), depth)
    return _chain(block, probs, depth, lambda d, row: int(row.argmax()), min_confidence, stop)


def posterior_log_rows(log_probs: torch.Tensor, log_pi: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log q(. | x_<i) for given tokens, batched and differentiable.

    log_probs: [..., M, K, V] log q_k(. | z); log_pi: [..., M] (normalised); tokens: [..., K] long
    -> [..., K, V]: row i conditioned on tokens[..., :i]."""
    K = log_probs.shape[-2]
    index = tokens.unsqueeze(-2).unsqueeze(-1).expand(*log_probs.shape[:-1], 1)  # [..., M, K, 1]
    at = log_probs.gather(-1, index).squeeze(-1)  # [..., M, K] log q_k(x_k | z)
    before = torch.cat((torch.zeros_like(at[..., :1]), at[..., : K - 1].cumsum(-1)), dim=-1)  # [..., M, K]
    log_post = (log_pi.unsqueeze(-1) + before).log_softmax(-2)  # [..., M, K] log pi(z | x_<i)
    return torch.logsumexp(log_post.unsqueeze(-1) + log_probs, dim=-3)  # [..., K, V]


def posterior_rows_reference(probs: torch.Tensor, pi: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """The slow form: probs [M, K, V], pi [M], tokens (k <= K) -> [k, V] float64,
    row i = sum_z pi(z) prod_{j<i} q_j(x_j|z) q_i(.|z) / sum_z pi(z) prod_{j<i} q_j(x_j|z)."""
    M = probs.shape[0]
    rows = []
    for i in range(len(tokens)):
        joint = []
        for z in range(M):
            w = float(pi[z])
            for j in range(i):
                w *= float(probs[z, j, tokens[j]])
            joint.append(w)
        total = sum(joint)
        rows.append(sum(joint[z] * probs[z, i].double() for z in range(M)) / total)
    return torch.stack(rows) if rows else probs.new_zeros(0, probs.shape[-1]).double()
