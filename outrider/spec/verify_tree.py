"""The tree walk: exact verification for drafters without probabilities (n-gram, suffix lookups).

At the current node draw y ~ p (the target's warped distribution there). If some child carries
token y, move to it (accepted) and repeat; otherwise commit y and stop. Each committed token is
a draw from p in its own context, whatever the drafter proposed, so the walk is exact for any
tree (chains included, duplicate siblings included: the first one is taken) and for any way
the drafts were made. Temperature 0 makes p one-hot and the walk greedy.

It is verify_greedy.py's walk with the choice drawn instead of taken as the argmax. The
vectorized form draws a choice at every node at once (the draws at nodes the walk never visits
are simply unused: independent draws, so the law is unchanged) and follows them in one sync.
"""

from __future__ import annotations

import torch

from ..sampling import SamplingParams
from .random import Random
from .types import DraftTree, VerifyResult
from .verify_chain import target_probs
from .tree import children, depths
from .verify_greedy import follow_chain, follow_tree


def verify_tree_walk_reference(
    tree: DraftTree, target_logits: torch.Tensor, params: SamplingParams, rng: Random
) -> VerifyResult:
    """The walk node by node, drawing only at the nodes it visits. target_logits: [n, vocab]."""
    tokens = tree.tokens.tolist()
    kids = children(tree.parents.tolist())
    depth = depths(tree.parents).tolist()
    node, accepted = 0, []
    while True:
        y = rng.categorical(target_probs(target_logits[node], params), offset=depth[node])
        nxt = next((c for c in kids[node] if tokens[c] == y), None)
        if nxt is None:
            return VerifyResult(accepted, [tokens[i] for i in accepted] + [y])
        accepted.append(nxt)
        node = nxt


def verify_tree_walk(
    tree: DraftTree, target_logits: torch.Tensor, params: SamplingParams, rng: Random
) -> VerifyResult:
    """The walk on any tree, vectorized: a draw at every node, one host sync. target_logits: [n, vocab]."""
    p = target_probs(target_logits, params)  # [n, vocab]
    return follow_tree(tree, rng.categorical_rows(p, depths(tree.parents).to(p.device)))


def verify_chain_walk(
    tree: DraftTree, target_logits: torch.Tensor, params: SamplingParams, rng: Random
) -> VerifyResult:
    """The walk on a chain, vectorized: a draw at every node, one host sync. target_logits: [n, vocab]."""
    p = target_probs(target_logits, params)  # [n, vocab]
    return follow_chain(tree, rng.categorical_rows(p, torch.arange(tree.size, device=p.device)))
