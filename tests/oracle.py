"""A drafter that knows the future: it proposes the target's own continuation, computed by a plain
run beforehand (past end-of-sequence tokens and every limit), so every draft it makes on the
reference path is accepted and the tests decide, not luck, where a round ends.

    drafter = OracleDrafter({tuple(prompt): plain_output}, "static:2,2", vocab=96, align=(p, j))

`align=(p, j)`: the round that commits output position p commits it at index j of its tokens
(0: the first draft; k - 1: the last draft of a k-draft round; k: the bonus), so a stopping
point at p falls at the first, a middle or the last place of a multi-token round. Rounds before
it are shortened to land there. Shapes: "chain"; "static:B1,B2,..." (a full tree, B_d children
per node at depth d, the reference child at a rotating sibling index so the accepted path is not
contiguous and K/V compaction runs); "dynamic" (the reference path with a wrong sibling at every
depth, and a wrong grandchild under each: an irregular tree).
"""

from __future__ import annotations

import torch

from outrider.drafters.base import DrafterBase
from outrider.drafters.capabilities import Capabilities, Drafts
from outrider.spec.types import DraftTree


class OracleDrafter(DrafterBase):
    name = "oracle"
    capabilities = Capabilities({"chain": Drafts("chain"), "static": Drafts("tree"), "dynamic": Drafts("tree")})

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], shape: str = "chain", *, vocab: int,
                 align: tuple[int, int] | None = None):
        self.continuations = continuations
        self.kind, _, arg = shape.partition(":")
        self.branching = [int(b) for b in arg.split(",")] if self.kind == "static" else []
        self.vocab = vocab
        self.align = align
        self._prompt_len: dict[int, int] = {}
        self._ref: dict[int, list[int]] = {}
        self.rounds: list[tuple[int, int]] = []  # (output position of the first draft, drafts proposed)

    # -- the drafter protocol ------------------------------------------------------------------
    def max_nodes(self, depth: int) -> int:
        if self.kind == "chain":
            return depth
        if self.kind == "dynamic":
            return 3 * depth
        total, width = 0, 1
        for d in range(depth):
            width *= self.branching[d] if d < len(self.branching) else 1
            total += width
        return total

    def start(self, seq_id: int, prompt: list[int], params=None) -> None:
        self._prompt_len[seq_id] = len(prompt)
        self._ref[seq_id] = self.continuations[tuple(prompt)]

    def propose(self, seq_id: int, tokens: list[int], budget) -> DraftTree:
        at = len(tokens) - self._prompt_len[seq_id]  # output position of the first draft
        ref = self._ref[seq_id]
        k = self._length(at, budget.depth)
        k = min(k, len(ref) - at)
        while k > 0 and self._size(k) > budget.nodes:
            k -= 1
        self.rounds.append((at, k))
        path = ref[at: at + k]
        if self.kind == "chain" or not path:
            return DraftTree.chain(tokens[-1], path)
        return self._tree(tokens[-1], path)

    def update(self, seq_id: int, result, hidden=None) -> None:
        pass

    def finish(self, seq_id: int, tokens: list[int]) -> None:
        self._prompt_len.pop(seq_id, None)
        self._ref.pop(seq_id, None)

    # -- where rounds end ----------------------------------------------------------------------
    def _length(self, at: int, depth: int) -> int:
        """Drafts this round so that output position p is committed at index j of its round."""
        if self.align is None:
            return depth
        p, j = self.align
        first = p - j  # the output position the aligned round starts at
        if at < first:
            return min(depth, first - at - 1)
        if at == first:
            return max(depth, j)  # j == depth: p is the bonus token
        return depth

    def _size(self, k: int) -> int:
        return k if self.kind == "chain" else self.max_nodes(k)

    # -- trees with the reference path inside ----------------------------------------------------
    def _wrong(self, token: int, n: int) -> int:
        return (token + 1 + n) % self.vocab

    def _tree(self, root: int, path: list[int]) -> DraftTree:
        tokens, parents = [root], [-1]
        if self.kind == "dynamic":
            on_path = 0  # node index of the reference path's last node
            for d, token in enumerate(path):
                wrong = len(tokens)
                if d % 2 == 0:  # the wrong sibling first: the accepted path is not contiguous
                    tokens += [self._wrong(token, 0), token]
                    parents += [on_path, on_path]
                    on_path = wrong + 1
                else:
                    tokens += [token, self._wrong(token, 0)]
                    parents += [on_path, on_path]
                    on_path, wrong = wrong, wrong + 1
                tokens.append(self._wrong(token, 1))  # a child under the wrong sibling
                parents.append(wrong)
            return DraftTree(torch.tensor(tokens), torch.tensor(parents))
        level = [(0, True)]  # (node index, on the reference path) at the current depth
        for d, token in enumerate(path):
            b = self.branching[d] if d < len(self.branching) else 1
            nxt = []
            for node, on in level:
                for s in range(b):
                    right = on and s == d % b
                    tokens.append(token if right else self._wrong(token, s))
                    parents.append(node)
                    nxt.append((len(tokens) - 1, right))
            level = nxt
        return DraftTree(torch.tensor(tokens), torch.tensor(parents))
