"""Shapes of draft trees for drafters that give a distribution at every node.

    chain           one token per depth; sampled from q when sampling (exact rejection sampling)
    static:2,2,1    branching per depth: the root gets 2 children, each of those 2, then 1 each
                    (top-b of q at each node: deterministic, verified by the tree walk)
    sampled:2,2,1   the same widths, but each node's children are drawn at random from q without
                    replacement (k sampled siblings; sampling only, temperature > 0; verified by
                    multi-draft rejection sampling, spec/verify_multidraft.py)
    dynamic:K,N     best-first (EAGLE-2 style): at each depth expand the K nodes with the highest
                    cumulative draft log-probability, then keep the best N nodes of all
    ddtree:N        DDTree, for block drafters (dflash): the N best prefixes of the block under the
                    product of its per-position distributions, best-first from a heap (one block
                    forward, no step per depth; verified by the tree walk)
    glance:N[,K[,E]] GLANCE's budget tree (docs/methods.md#glance), for block drafters: the N best
                    prefix-closed nodes best-first under offset independence, each position's top K
                    (default 8) its candidates; E > 0: one extra draft pass past the block, its E
                    best nodes hung off the greedy spine when the spine is confident enough
    pctree:N        PCTree (docs/methods.md#pctree), for DSpark's block: the N most probable
                    prefixes best-first, each node's children scored by the Markov head given that
                    node's own token (one backbone pass; verified by the tree walk)

Parsing is pure and refuses bad strings with a one-line ConfigError.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError


@dataclass(frozen=True)
class TreeShape:
    kind: str  # "chain", "static", "sampled", "dynamic" or "ddtree"
    branching: tuple[int, ...] = ()  # static and sampled: children per node at each depth
    top_k: int = 0  # dynamic: nodes expanded per depth (and children tried per node)
    max_nodes: int = 0  # dynamic, ddtree, glance, pctree: drafted nodes kept
    extra: int = 0  # glance: nodes of the extra draft pass past the block (0: none)

    @property
    def is_chain(self) -> bool:
        return self.kind == "chain"

    def max_drafts(self, depth: int) -> int:
        """Most draft nodes (root excluded) this shape makes when `depth` deep."""
        if self.kind == "chain":
            return depth
        if self.kind in ("static", "sampled"):
            total, width = 0, 1
            for b in self.branching[:depth]:
                width *= b
                total += width
            return total
        return self.max_nodes + self.extra

    def fed_nodes(self, depth: int) -> int:
        """Most nodes a model drafter feeds through its own forward (so writes to its cache,
        after the root's row) while drafting `depth` deep: every depth but the last is fed.
        Dynamic trees feed the K expanded nodes per depth, which can exceed the N they keep."""
        if self.kind == "chain":
            return max(depth - 1, 0)
        if self.kind in ("static", "sampled"):
            return self.max_drafts(self.max_depth(depth) - 1)
        if self.kind in ("ddtree", "glance", "pctree"):
            return 0  # one block forward (glance: two), nothing fed per depth
        return self.top_k * max(depth - 1, 0)

    def max_depth(self, depth: int) -> int:
        return min(depth, len(self.branching)) if self.kind in ("static", "sampled") else depth

    def __str__(self) -> str:
        if self.kind in ("static", "sampled"):
            return f"{self.kind}:" + ",".join(map(str, self.branching))
        if self.kind == "dynamic":
            return f"dynamic:{self.top_k},{self.max_nodes}"
        if self.kind in ("ddtree", "pctree"):
            return f"{self.kind}:{self.max_nodes}"
        if self.kind == "glance":
            return f"glance:{self.max_nodes},{self.top_k}" + (f",{self.extra}" if self.extra else "")
        return "chain"


def parse_shape(text: str) -> TreeShape:
    kind, _, args = text.partition(":")
    try:
        numbers = tuple(int(x) for x in args.split(",")) if args else ()
    except ValueError:
        raise ConfigError(f"--tree {text!r}: numbers expected after ':' (e.g. static:2,2,1 or dynamic:4,16)") from None
    if kind == "chain" and not numbers:
        return TreeShape("chain")
    if kind in ("static", "sampled") and numbers and all(1 <= n <= 16 for n in numbers):
        return TreeShape(kind, branching=numbers)
    if kind == "dynamic" and len(numbers) == 2 and 1 <= numbers[0] <= 16 and numbers[1] >= 1:
        return TreeShape("dynamic", top_k=numbers[0], max_nodes=numbers[1])
    if kind in ("ddtree", "pctree") and len(numbers) == 1 and 1 <= numbers[0] <= 1024:
        return TreeShape(kind, max_nodes=numbers[0])
    if kind == "glance" and 1 <= len(numbers) <= 3 and 1 <= numbers[0] <= 1024:
        branch, extra = (numbers[1:] + (8, 0)[len(numbers) - 1:])[:2]
        if 1 <= branch <= 64 and 0 <= extra <= 1024:
            return TreeShape("glance", top_k=branch, max_nodes=numbers[0], extra=extra)
    raise ConfigError(
        f"--tree {text!r} is not a tree shape: use chain, static:B1,B2,... or sampled:B1,B2,... (1-16 per depth) "
        f"or dynamic:K,N or ddtree:N or glance:N[,K[,E]] (block drafters, N <= 1024, K <= 64) or pctree:N (dspark)"
    )
