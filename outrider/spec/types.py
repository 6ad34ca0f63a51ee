"""The vocabulary of one speculative round, as plain data.

A **draft tree** holds `n` nodes. Node 0 is the **root**: the last committed token, whose K/V is
not yet in the cache (the verify forward writes it). Every other node is a drafted token whose
parent has a smaller index. A **chain** of k drafts has parents `[-1, 0, 1, ..., k-1]`.
Autoregressive decoding is the round with a tree of the root alone.

Worked example (root `r`, two candidates for the first draft, one continuation of the first):

    node     0    1    2    3
    token    r    a    b    c        parents = [-1, 0, 0, 1]
    depth    0    1    1    2        position of node i = cache_len + depth[i]

`draft_probs[i]` (optional) is the drafter's distribution over the token that follows node i:
the children of node i were drawn from it. Exact sampling verifiers need it; greedy does not.

`confidence[i]` (optional) is the drafter's own probability that node i's path is right: the
product along the path of the probability it gave each token (its q for a model or head, the
count share for suffix trees), so `confidence[0] == 1` and a child never exceeds its parent. In
the example, with q(a) = 0.6, q(b) = 0.3 and q(c | a) = 0.5: confidence = [1, 0.6, 0.3, 0.3].
Only speculation-length controllers read it (control/libraspec.py); verifiers never do.

A **budget** is how much a controller lets a drafter draft for one sequence this round; the
**tree kind** is what a verifier receives, a chain or any tree (a drafter declares it per
`--tree` kind: drafters/capabilities.py; spec/verifiers.py chooses from it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

TREE_KINDS = ("chain", "tree")  # what a verifier receives: parents [-1, 0, ..., k-1], or any tree


@dataclass(frozen=True)
class Budget:
    """How much to draft this round: at most `depth` tokens deep and `nodes` drafts in all.

    A drafter with confidences may stop a path early once its probability (the product of the
    draft probabilities along it) falls below `min_confidence`. A model drafter drafting a chain
    calls `stop(entropies)` after each draft, with the entropies (nats) of the distributions the
    drafts so far came from, and drafts no deeper once it says True (`--controller entropy`,
    control/entropy.py); other drafters and trees ignore it.
    """

    depth: int
    nodes: int
    min_confidence: float = 0.0
    stop: Callable[[list[float]], bool] | None = None


@dataclass(frozen=True)
class DraftTree:
    tokens: torch.Tensor  # [n] long; tokens[0] is the root
    parents: torch.Tensor  # [n] long; parents[0] == -1, parents[i] < i
    draft_probs: torch.Tensor | None = None  # [n, vocab] float, row i: q(. | path to node i)
    confidence: torch.Tensor | None = None  # [n] float, the drafter's probability of each node's path

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    @staticmethod
    def root_only(root: int) -> "DraftTree":
        return DraftTree(torch.tensor([root]), torch.tensor([-1]))

    @staticmethod
    def chain(root: int, drafts: list[int], draft_probs: torch.Tensor | None = None) -> "DraftTree":
        tokens = torch.tensor([root, *drafts], dtype=torch.long)
        parents = torch.arange(-1, len(drafts), dtype=torch.long)
        return DraftTree(tokens, parents, draft_probs)

    def is_chain(self) -> bool:
        return bool(torch.equal(self.parents, torch.arange(-1, self.size - 1)))


@dataclass(frozen=True)
class VerifyResult:
    """What one slot commits this round.

    `accepted_nodes` are the indices of the accepted draft nodes, root to leaf (the root is
    never listed). `tokens` are the committed tokens: the accepted drafts followed by one more,
    the bonus (all children of the last accepted node were accepted or it had none) or the
    recovered token (sampled after a rejection). So `len(tokens) == len(accepted_nodes) + 1`.
    """

    accepted_nodes: list[int]
    tokens: list[int]

    @property
    def num_accepted(self) -> int:
        return len(self.accepted_nodes)


@dataclass
class RoundStats:
    """Per-request counters, summed over rounds."""

    rounds: int = 0
    committed: int = 0
    drafted: int = 0
    accepted_by_position: list[int] = field(default_factory=list)  # [depth-1] -> accepted count
    proposed_by_position: list[int] = field(default_factory=list)  # [depth-1] -> rounds with a draft there
    accepted_length_hist: list[int] = field(default_factory=list)  # [num_accepted] -> rounds
    committed_by_round: list[int] = field(default_factory=list)  # tokens each round committed, in order
    draft_s: float = 0.0
    verify_s: float = 0.0
