"""Prompt lookup decoding: copy what followed the last n-gram the previous time it was seen.

The drafter looks at the last `n` committed tokens (n from `max_ngram` down to `min_ngram`),
finds their most recent earlier occurrence in prompt + output so far, and proposes the tokens
that followed it as a chain. No model, no training: it wins on text that repeats its context
(code edits, summaries that quote, structured output).

Worked example (max_ngram=2, depth 3):

    position  0 1 2 3 4 5 6
    token     a b c d x a b        last 2-gram (a, b) was seen at 0..1, followed from 2 by
                                   c d x  ->  chain  b -> c -> d -> x   (b is the root)

The index maps every n-gram that already has a follower to the position of that follower, the
latest occurrence winning. The n-gram ending at the last token has no follower yet, so it is not
in the index and a lookup never finds the sequence's own tail. Appending one token adds at most
`max_ngram - min_ngram + 1` entries, so keeping the index costs O(1) per committed token and a
proposal costs O(depth), whatever the length of the sequence.

When the copy runs past the end of the sequence (a repeat whose period is shorter than the
draft), it keeps copying from its own drafts, like an overlapping LZ77 copy: for `a b a b a b`
with depth 4 it proposes `a b a b`, exactly what the next lookup would propose if these drafts
were accepted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import ConfigError
from ..sampling import SamplingParams
from ..spec.types import Budget, DraftTree, VerifyResult
from .base import DrafterBase, catch_up
from .capabilities import Capabilities, Drafts
from .registry import DrafterEntry, register


@dataclass
class NgramState:
    """One sequence: its committed tokens and the follower position of each n-gram seen."""

    tokens: list[int] = field(default_factory=list)
    follower: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> index after it


class NgramDrafter(DrafterBase):
    """Prompt lookup: the chain that followed the most recent earlier match of the last n-gram."""

    name = "ngram"
    capabilities = Capabilities(trees={"chain": Drafts("chain")}, catches_up=True)  # copies, without probabilities

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if min_ngram < 1:
            raise ConfigError(f"ngram min_ngram must be >= 1, got {min_ngram}")
        if max_ngram < min_ngram:
            raise ConfigError(f"ngram max_ngram must be >= min_ngram ({min_ngram}), got {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self._states: dict[int, NgramState] = {}

    # -- protocol -----------------------------------------------------------------------------

    def max_nodes(self, depth: int) -> int:
        """Drafts in a proposal of this depth at most: a chain."""
        return depth

    def start(self, seq_id: int, prompt: list[int], params: SamplingParams | None = None) -> None:
        """`params` is accepted and unused: the drafts do not depend on sampling."""
        state = NgramState()
        self._append(state, prompt)
        self._states[seq_id] = state

    def propose(self, seq_id: int, tokens: list[int], budget: Budget) -> DraftTree:
        state = self._synced_state(seq_id, tokens)
        return DraftTree.chain(tokens[-1], self.lookup(state, min(budget.depth, budget.nodes)))

    def update(self, seq_id: int, result: VerifyResult, hidden: torch.Tensor | None = None) -> None:
        state = self._states.get(seq_id)
        if state is not None:  # an unknown sequence is started from `tokens` at its next proposal
            self._append(state, result.tokens)

    def finish(self, seq_id: int, tokens: list[int]) -> None:
        self._states.pop(seq_id, None)

    # -- the index ----------------------------------------------------------------------------

    def match(self, seq_id: int, tokens: list[int], num_drafts: int) -> tuple[int, list[int]]:
        """`propose`'s chain below tokens[-1] with the length n of the n-gram it followed (0: none);
        oilbird.py scores the chain by n."""
        return self.matched(self._synced_state(seq_id, tokens), num_drafts)

    def lookup(self, state: NgramState, num_drafts: int) -> list[int]:
        """Up to `num_drafts` tokens that followed the longest matching n-gram; [] when none."""
        return self.matched(state, num_drafts)[1]

    def matched(self, state: NgramState, num_drafts: int) -> tuple[int, list[int]]:
        """(n, drafts): the longest matching n-gram's length and up to `num_drafts` tokens that
        followed it; (0, []) when none."""
        seq = state.tokens
        length = len(seq)
        if num_drafts <= 0:
            return 0, []
        for n in range(min(self.max_ngram, length), self.min_ngram - 1, -1):
            start = state.follower.get(tuple(seq[length - n :]))
            if start is None:
                continue
            drafts: list[int] = []
            for k in range(num_drafts):
                at = start + k  # past the end, copy from the drafts themselves
                drafts.append(seq[at] if at < length else drafts[at - length])
            return n, drafts
        return 0, []

    def _append(self, state: NgramState, new_tokens: list[int]) -> None:
        """Commit tokens: each gives a follower to the n-grams that end just before it."""
        seq = state.tokens
        for token in new_tokens:
            at = len(seq)
            for n in range(self.min_ngram, min(self.max_ngram, at) + 1):
                state.follower[tuple(seq[at - n : at])] = at
            seq.append(token)

    def _synced_state(self, seq_id: int, tokens: list[int]) -> NgramState:
        """The state for `tokens`: kept when it matches, extended when behind, rebuilt otherwise."""
        state = self._states.get(seq_id)
        if catch_up(state, tokens, self._append):
            return state
        self.start(seq_id, tokens)
        return self._states[seq_id]


register(DrafterEntry("ngram", "ngram", NgramDrafter.capabilities,
                      build=lambda argument, shape, target, target_path: NgramDrafter()))
