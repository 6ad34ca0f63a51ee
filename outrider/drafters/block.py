"""A drafted block and the trees built from it: the block's argmax chain, a sampled chain, DDTree.

A block drafter (dflash.py) drafts K = B-1 tokens in one forward: position k (1..K) of the block
gets a distribution of its own, computed from the committed context alone, never from the tokens
drafted at positions before it. Everything that turns such a block into a draft tree lives here
or in refiners/ (which take a `Block` and the tree so far and return a new tree).

    chain           greedy: the argmax of each position (the block as DFlash verifies it);
                    sampling: each position's token drawn from its own q_k (q kept: the chain
                    verifier's rejection sampling is exact for any proposal fixed before the draw,
                    and q_k is fixed by the context: it does not depend on the earlier drafts)
    ddtree:N        DDTree (Ringel & Romano, arXiv 2604.12989): the N prefixes of highest
                    probability under the product of the per-position marginals, taken
                    best-first from a heap; a prefix's score is at most its parent's, so the N
                    best always form a tree (each node's parent is among them)
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import torch

from ..heads.vocab_map import to_target_ids, to_target_logits
from ..sampling import SamplingParams, warp_probs
from ..spec.types import DraftTree, VerifyResult


@dataclass
class Block:
    """One sequence's drafted block (K = B-1 draft positions).

    logits: [K, Vd] float32, position k+1's draft logits over the draft vocabulary;
    hidden: [B, H] the drafter's last hidden states (slot 0 is the root's);
    to_target: [Vd] long draft id -> target id, or None (identity);
    previous: last round's result for this sequence and the tree it verified (None at first)."""

    root: int
    position: int  # the root's position (committed tokens - 1)
    logits: torch.Tensor
    hidden: torch.Tensor
    vocab: int  # V, the target's
    to_target: torch.Tensor | None = None
    committed: list[int] = field(default_factory=list)
    previous: VerifyResult | None = None
    previous_tree: DraftTree | None = None
    _logp: torch.Tensor | None = field(default=None, repr=False)

    @property
    def size(self) -> int:
        return int(self.logits.shape[0])

    @property
    def logp(self) -> torch.Tensor:
        """[K, Vd] log-softmax of the logits (computed once)."""
        if self._logp is None:
            self._logp = torch.log_softmax(self.logits.float(), dim=-1)
        return self._logp

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return to_target_ids(self.to_target, draft_ids)

    def target_logits(self, k: int) -> torch.Tensor:
        """Position k+1's logits over the target vocabulary [V] (-inf off the draft vocabulary)."""
        return to_target_logits(self.to_target, self.logits[k].float(), self.vocab)

    def prob(self, k: int, token: int) -> float:
        """Position k+1's draft probability of target token `token` (0 off the draft vocabulary),
        read from `logp` without building a [V] row."""
        if self.to_target is None:
            return float(self.logp[k, token].exp())
        at = (self.to_target == token).nonzero()
        return float(self.logp[k, int(at[0, 0])].exp()) if at.numel() else 0.0

    def argmax(self, depth: int) -> list[int]:
        """The block's own proposal: target ids of the first `depth` positions' argmax."""
        return self.target_ids(self.logits[:depth].argmax(-1)).tolist()

    def entropy(self) -> torch.Tensor:
        """[K] entropy (nats) of each position's draft distribution."""
        p = self.logp.exp()
        return -(p * self.logp).sum(-1)


def greedy_chain(block: Block, depth: int, min_confidence: float = 0.0, stop=None) -> DraftTree:
    """The argmax of positions 1..depth; cut after the first whose path probability falls below
    `min_confidence` or where `stop(entropies so far)` says so (that draft is kept)."""
    depth = min(depth, block.size)
    if depth < 1:
        return DraftTree.root_only(block.root)
    top = block.logp[:depth].max(-1)  # values [depth], indices
    share = top.values.exp().tolist()
    entropies = block.entropy()[:depth].tolist() if stop is not None else []
    tokens, confidence = block.target_ids(top.indices).tolist(), [1.0]
    keep = depth
    for d in range(depth):
        confidence.append(confidence[-1] * share[d])
        if confidence[-1] < min_confidence or (stop is not None and stop(entropies[: d + 1])):
            keep = d + 1
            break
    return DraftTree(torch.tensor([block.root, *tokens[:keep]]), torch.arange(-1, keep),
                     confidence=torch.tensor(confidence[: keep + 1]))


def sampled_chain(block: Block, depth: int, params: SamplingParams, rng, min_confidence: float = 0.0,
                  stop=None) -> DraftTree:
    """Position d's draft drawn from q_d (the warped draft distribution over [V]), by the
    request's drafting stream at offset d - 1 (rng: already `.at(len(committed))`); the q's kept."""
    depth = min(depth, block.size)
    if depth < 1:
        return DraftTree.root_only(block.root)
    drafts, qs, confidence, entropies = [], [], [1.0], []
    for d in range(depth):
        q = warp_probs(block.target_logits(d), params)  # [V]
        token = rng.categorical(q, offset=d)
        drafts.append(token)
        qs.append(q)
        confidence.append(confidence[-1] * float(q[token]))
        if stop is not None:
            entropies.append(float(-(q[q > 0] * q[q > 0].log()).sum()))
        if confidence[-1] < min_confidence or (stop is not None and stop(entropies)):
            break
    probs = torch.zeros(len(drafts) + 1, block.vocab)
    probs[: len(drafts)] = torch.stack(qs).cpu()
    tree = DraftTree.chain(block.root, drafts, probs)
    return DraftTree(tree.tokens, tree.parents, tree.draft_probs, torch.tensor(confidence))


def ddtree(block: Block, depth: int, nodes: int) -> DraftTree:
    """DDTree: the `nodes` best prefixes (at most `depth` deep) by the sum of per-position
    log-probabilities, best-first. A heap entry is a prefix given by its parent node and the rank
    of its last token among that position's tokens; popping one adds it and offers its first
    child (rank 0 one position deeper) and its next sibling (the next rank at its position)."""
    depth = min(depth, block.size)
    if depth < 1 or nodes < 1:
        return DraftTree.root_only(block.root)
    width = min(nodes, block.logp.shape[-1])
    top = block.logp[:depth].topk(width, dim=-1)  # values/indices [depth, width], ranked
    values = top.values.tolist()
    ids = block.target_ids(top.indices).tolist()
    tokens, parents, scores = [block.root], [-1], [0.0]
    heap = [(-values[0][0], 0, 0, 0)]  # (-score, parent node, rank, position index d: 0-based)
    while heap and len(tokens) - 1 < nodes:
        neg, parent, rank, d = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(ids[d][rank])
        parents.append(parent)
        scores.append(-neg)
        if d + 1 < depth:
            heapq.heappush(heap, (neg - values[d + 1][0], node, 0, d + 1))
        if rank + 1 < width:
            heapq.heappush(heap, (neg + values[d][rank] - values[d][rank + 1], parent, rank + 1, d))
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), confidence=torch.tensor(scores).exp())
