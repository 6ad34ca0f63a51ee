"""What the router knows of each replica's prefix cache: the prompts it sent there, in whole blocks.

    index = PrefixIndex(block=16, max_blocks=65536)
    index.add(prompt_ids)           # a prompt routed to this replica (its engine keeps its blocks)
    index.match(prompt_ids)         # tokens of the longest prefix of whole blocks it holds (a multiple of 16)

A replica's engine keeps the K/V of every prompt it prefilled (and of its answer) in blocks of
P tokens, each keyed by the block before it and its own tokens (engine/prefix_cache.py); a
request whose prompt starts with blocks a replica holds prefills only the rest there. The
router cannot see into the replicas' caches between requests without a round trip per request,
so it keeps the same chain for each replica from what it routed: a node per whole block, keyed
by (its parent's node, the block's tokens), compared token for token (no hash collisions), with
the least recently used dropped past `max_blocks`. It is an estimate of what the replica holds:
the replica's own cache may have evicted a block (its byte budget) or hold more (the answers,
which the router does not see); a wrong guess costs a prefill, never a wrong token.

`match` walks the chain from the first block, so it costs one dictionary look-up per block;
both `add` and `match` mark the blocks they touch as used (a parent is always touched before its
children, so eviction drops leaves before the blocks they hang from, unless those went unused).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

BLOCK = 16  # tokens a block (the engine's default --prefix-cache-block)
MAX_BLOCKS = 1 << 16  # blocks remembered per replica (a replica's 256 MB cache holds ~10^4 SmolLM2 blocks)


class PrefixIndex:
    def __init__(self, block: int = BLOCK, max_blocks: int = MAX_BLOCKS):
        if block < 1 or max_blocks < 1:
            raise ValueError(f"block and max_blocks must be positive, got {block} and {max_blocks}")
        self.block = block
        self.max_blocks = max_blocks
        self._nodes: OrderedDict[tuple[int, tuple[int, ...]], int] = OrderedDict()  # (parent, tokens) -> node
        self._next = 1  # node ids; 0 is the root (the empty prefix)

    def __len__(self) -> int:
        return len(self._nodes)

    def _blocks(self, ids: Sequence[int]):
        for start in range(0, len(ids) - self.block + 1, self.block):
            yield tuple(ids[start: start + self.block])

    def match(self, ids: Sequence[int]) -> int:
        """Tokens of the longest prefix of `ids`, in whole blocks, that this index holds."""
        parent, matched = 0, 0
        for tokens in self._blocks(ids):
            node = self._nodes.get((parent, tokens))
            if node is None:
                break
            self._nodes.move_to_end((parent, tokens))
            parent, matched = node, matched + self.block
        return matched

    def add(self, ids: Sequence[int]) -> None:
        """Remember every whole block of `ids` as held (the last partial block is not kept: the
        engine keeps whole blocks only)."""
        parent = 0
        for tokens in self._blocks(ids):
            key = (parent, tokens)
            node = self._nodes.get(key)
            if node is None:
                node = self._nodes[key] = self._next
                self._next += 1
            else:
                self._nodes.move_to_end(key)
            parent = node
        while len(self._nodes) > self.max_blocks:
            self._nodes.popitem(last=False)  # the least recently used

    def clear(self) -> None:
        """Forget everything (the replica died: its restart begins with an empty cache)."""
        self._nodes.clear()
