"""Greedy verification, and the walk that follows one chosen token per node.

A **choice** is one token per node: `choice[i]` is the token the target commits after node i
(greedy: the argmax of its logits; the tree walk of verify_tree.py: a draw from p). The **walk**
starts at the root and moves to the first child (smallest index) whose token equals the current
node's choice; the children it moves through are accepted. At a node with no such child it
commits that node's choice (the bonus) and stops. So the committed tokens are exactly the
choices along the accepted path, and greedy commits exactly the target's greedy tokens.

Duplicate siblings (same token, same parent) see the same context, so the first one stands for
all; a drafter should not send them. Exact for temperature 0 only: greedy verification at a
positive temperature would be lossy, and the registry (verifiers.py) refuses it.

Three forms of one walk: `walk` (a Python loop over nodes, on host lists; the reference
`verify_greedy_reference` reads the argmax and runs it), and two vectorized ones with a single
host read, `follow_chain` for chains and `follow_tree` for trees.

The registered greedy verifiers (`greedy_chain`, `greedy_tree`: spec/verifiers.py) are
`GreedyVerifier`s. Called with one tree's logits, as every verifier can be, one reads that tree's
argmax (`follow_chain` / `follow_tree`: one host read). A round does better: it reads the argmax
of every real row of the batch in one host transfer (`choices`, in engine/verify.py) and hands
each greedy sequence its own rows' choices (`from_choices`, which walks them on the host), so a
batch of greedy sequences costs one host read a round, whatever its size.
"""

from __future__ import annotations

import torch

from ..sampling import SamplingParams
from .tree import children
from .types import DraftTree, VerifyResult


def verify_greedy_reference(
    tree: DraftTree, target_logits: torch.Tensor, params: SamplingParams | None = None, rng: object = None
) -> VerifyResult:
    """The walk node by node. target_logits: [n, vocab]."""
    return walk(tree.tokens.tolist(), tree.parents.tolist(), target_logits.argmax(-1).tolist())


def walk(tokens: list[int], parents: list[int], choice: list[int]) -> VerifyResult:
    """The walk on host lists: tokens, parents and choice (the token committed after each node)."""
    kids = children(parents)
    node, accepted = 0, []
    while True:
        nxt = next((c for c in kids[node] if tokens[c] == choice[node]), None)
        if nxt is None:
            return VerifyResult(accepted, [tokens[i] for i in accepted] + [choice[node]])
        accepted.append(nxt)
        node = nxt


class GreedyVerifier:
    """A greedy verifier: the walk on the target's argmax, exact at temperature 0 (module notes).

    follow: `follow_chain` (greedy_chain: chains only) or `follow_tree` (greedy_tree: any tree).
    """

    def __init__(self, follow):
        self.follow = follow

    def __call__(self, tree: DraftTree, target_logits: torch.Tensor, params: SamplingParams | None = None,
                 rng: object = None) -> VerifyResult:
        """The registry's signature: one tree alone, vectorized. target_logits: [n, vocab]."""
        return self.follow(tree, target_logits.argmax(-1))

    def from_choices(self, tree: DraftTree, choice: list[int]) -> VerifyResult:
        """The same result from the argmax of the tree's rows already on the host (`choices`)."""
        return walk(tree.tokens.tolist(), tree.parents.tolist(), choice)


def choices(logits: torch.Tensor) -> torch.Tensor:
    """logits [rows, vocab] -> [rows] long: each row's argmax, what a greedy verifier commits after
    that row's node. A round reads it for every real row at once (`GreedyVerifier.from_choices`)."""
    return logits.argmax(-1)


def follow_chain(tree: DraftTree, choice: torch.Tensor) -> VerifyResult:
    """The walk on a chain. choice: [n] long. One host sync.

    Worked example: tokens [r, a, b, c], choice [a, b, x, y]
        match   = tokens[1:] == choice[:-1] = [T, T, F]
        cumprod = [1, 1, 0] -> 2 accepted
        commit  = choice[:3] = [a, b, x]   (an accepted draft equals its parent's choice)
    """
    drafts = tree.tokens[1:].to(choice.device)  # [k]
    match = drafts == choice[:-1]  # [k]: draft at node i+1 is node i's choice
    num_accepted = match.long().cumprod(0).sum()  # [] matches before the first mismatch
    host = torch.cat([num_accepted.view(1), choice]).tolist()  # the one sync
    a = host[0]
    return VerifyResult(list(range(1, a + 1)), host[1 : a + 2])


def follow_tree(tree: DraftTree, choice: torch.Tensor) -> VerifyResult:
    """The walk on any tree. choice: [n] long. One host sync; ceil(log2 n) vectorized steps.

    Worked example, parents [-1, 0, 0, 1, 2]:
        node       0  1  2  3  4
        token      r  a  b  c  d
        choice     b  x  d  y  z
        match      T  F  T  F  T     token[i] == choice[parents[i]], and no earlier sibling matched
        on path    T  F  T  F  T     match at the node and at every ancestor
        -> accepted nodes [2, 4] (on-path nodes in index order run root to leaf), commit [b, d, z]
    "Every ancestor" by pointer doubling: after s steps on_path[i] covers node i and its next
    2**s - 1 ancestors (the root points at itself), so 2**s >= n covers every depth.
    """
    n = tree.size
    device = choice.device
    tokens = tree.tokens.to(device)  # [n]
    parents = tree.parents.to(device)  # [n]
    index = torch.arange(n, device=device)  # [n]
    up = parents.clamp(min=0)  # [n]; the root is its own parent
    match = (tokens == choice[up]) | (index == 0)  # [n]
    earlier_sibling = (parents[None, :] == parents[:, None]) & (index[None, :] < index[:, None])  # [n, n]
    on_path = match & ~(earlier_sibling & match[None, :]).any(-1)  # [n]
    for _ in range((n - 1).bit_length()):
        on_path = on_path & on_path[up]
        up = up[up]
    host = torch.stack([on_path.long(), choice, tokens]).tolist()  # the one sync
    accepted = [i for i in range(1, n) if host[0][i]]
    leaf = accepted[-1] if accepted else 0
    return VerifyResult(accepted, [host[2][i] for i in accepted] + [host[1][leaf]])


verify_greedy_chain = GreedyVerifier(follow_chain)  # registered as greedy_chain
verify_greedy_tree = GreedyVerifier(follow_tree)  # registered as greedy_tree
