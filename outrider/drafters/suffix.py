"""SuffixDecoding (Oliaro et al. 2024): speculation trees grown from suffix-tree counts.

Two suffix trees (see `suffix_tree.py`) answer "what followed this context before?":

- the **per-request** tree over the request's prompt + output so far, grown as tokens commit;
- the **global** tree over the outputs of earlier requests (added at `finish`), holding at most
  `global_max_tokens` tokens and `global_max_sequences` outputs, the oldest evicted first.
  `--drafter suffix:local` keeps no global tree (`global_max_tokens` 0): the request's own text is
  its whole pool, as for prompt lookup (ngram.py).

Each round, in each tree, the drafter takes the longest suffix of the committed sequence (at most
`max_match` tokens) that the tree has seen followed by something, and from its node grows a
**speculation tree** best first: a candidate's score is the product along its path of
`count(child) / count(continuations of the parent)`, the frequency with which each token followed
its context. Candidates below `min_prob` are dropped; at most `max_spec` nodes are taken, where

    max_spec = min(budget.nodes, floor(alpha * match_length))

so a long match (a confident context) speculates further than a short one. `budget.depth` caps
the depth. A speculation's score is the sum of its node scores (the expected number of accepted
tokens if the counts were the truth), and the best-scoring one is kept, as in the paper: between
the two trees (the per-request one wins ties), and also between the longest match m and the
shorter matches m // 2, m // 4, ... (tried only while their max_spec could still win). The
shorter matches matter in repeats: in `x x x x x x` the longest earlier match `x x x x x` is
followed by one token before the text ends, while `x x` (5 // 2) is followed by four. Keeping one tree
rather than merging spends the whole node budget on the better-informed source and keeps the
scores comparable.

Denominators count continuations only: a window that ends at a node (the end of a sequence, the
depth cap, or the request's own latest suffix) says nothing about what follows.

Defaults, from `scripts/bench_suffix_drafting.py` (an oracle target over Python source, budget
depth 8 / 16 nodes): alpha 1, the low end of the usual 1 to 4, because alpha 2 and 4 raised tau
by only 0.09 and 0.16 for 1.7x and 2.7x the drafted tokens, poor value where each verified token
costs (the CPU); raise it where verification is nearly free. min_prob 0.1: a path must have
followed its context at least one time in ten.
max_depth 32 with max_match 16: tau was the same from 64/32 down to 16/8 while per-token update
cost grows with the depth; 32 leaves 16 tokens of speculation below the longest match.

Matching is incremental. The per-request tree's walkers are exactly the request's repeated
suffixes. For the global tree each request keeps read cursors, one per suffix that the tree
holds (at most `max_match`), stepped by each committed token; when the global tree changes
(another request finished), the cursors are rebuilt from the last `max_match` tokens.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..errors import ConfigError
from ..sampling import SamplingParams
from ..spec.types import Budget, DraftTree, VerifyResult
from .base import DrafterBase, catch_up
from .capabilities import Capabilities, Drafts
from .registry import DrafterEntry, register
from .suffix_tree import Position, SuffixTree, has_continuation, step

LOCAL_KEY = 0  # the one sequence of a per-request tree


@dataclass
class Speculation:
    """Drafts below the root: node i + 1 of the tree is `tokens[i]`, child of `parents[i]`."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)  # tree indices (0 is the root)
    scores: list[float] = field(default_factory=list)  # path probability of each draft

    @property
    def score(self) -> float:
        return sum(self.scores)


def speculate(
    children: Callable[[object, float], tuple[int, list[tuple[int, int, object]]]],
    start: object,
    max_nodes: int,
    max_depth: int,
    min_prob: float,
) -> Speculation:
    """Grow a speculation tree best first from `start`.

    `children(position, min_share)` gives (total, [(token, count, child position), ...]): the
    tokens seen after `position` with count >= min_share * total (it may give more), and the sum
    of the counts of all of them. A child's score is its parent's times count / total.
    Scores never grow along a path, so popping the best candidate always pops a parent before its
    children and the result is the `max_nodes` best-scoring paths at or above `min_prob`. Ties go
    to the earlier pushed candidate, siblings ordered by count then token: deterministic.
    """
    spec = Speculation()
    heap: list[tuple[float, int, int, int, int, object]] = []  # (-score, order, parent, token, depth, pos)
    pushed = 0

    def push_children(position: object, parent: int, score: float, depth: int) -> None:
        nonlocal pushed
        total, options = children(position, min_prob / score * (1 - 1e-9))  # exact test below
        if len(options) > 1:
            options.sort(key=lambda o: (-o[1], o[0]))
        for token, count, child in options:
            child_score = score * count / total
            if child_score < min_prob:
                break  # sorted by count: the rest score lower
            heapq.heappush(heap, (-child_score, pushed, parent, token, depth + 1, child))
            pushed += 1

    if max_nodes > 0 and max_depth > 0:
        push_children(start, 0, 1.0, 0)
    while heap and len(spec.tokens) < max_nodes:
        neg_score, _, parent, token, depth, position = heapq.heappop(heap)
        spec.tokens.append(token)
        spec.parents.append(parent)
        spec.scores.append(-neg_score)
        if depth < max_depth:
            push_children(position, len(spec.tokens), -neg_score, depth)
    return spec


@dataclass
class GlobalCursors:
    """A request's read positions in the global tree: (suffix length, position), longest first."""

    version: int = -1
    cursors: list[tuple[int, Position]] = field(default_factory=list)


@dataclass
class SuffixState:
    """One request: its own tree (prompt + output), the prompt length, its global cursors."""

    tree: SuffixTree
    prompt_len: int
    global_cursors: GlobalCursors = field(default_factory=GlobalCursors)

    @property
    def tokens(self) -> list[int]:
        return self.tree.sequences[LOCAL_KEY]


def spec_tree(root: int, spec: Speculation) -> DraftTree:
    """A speculation below `root` as a draft tree, its scores as the nodes' confidence."""
    if not spec.tokens:
        return DraftTree.root_only(root)
    return DraftTree(
        torch.tensor([root, *spec.tokens], dtype=torch.long),  # [n]
        torch.tensor([-1, *spec.parents], dtype=torch.long),  # [n]
        confidence=torch.tensor([1.0, *spec.scores], dtype=torch.float64),  # [n] path probabilities
    )


class SuffixDrafter(DrafterBase):
    """Speculation trees from a per-request and a global suffix tree (training-free)."""

    name = "suffix"
    # it asks for no shape: its speculation trees branch where the counts do, without probabilities
    capabilities = Capabilities(trees={"chain": Drafts("tree")}, catches_up=True)  # _synced_state

    def __init__(
        self,
        max_depth: int = 32,
        max_match: int = 16,
        alpha: float = 1.0,
        min_prob: float = 0.1,
        global_max_tokens: int = 100_000,
        global_max_sequences: int = 1_000,
    ):
        """max_depth: window length of both trees; max_match: longest suffix matched (leaving
        max_depth - max_match tokens to speculate below it); alpha: speculated nodes per matched
        token; min_prob: the lowest path score drafted; global_max_tokens/sequences: the global
        tree's bound (about 650 bytes per token at max_depth 32), oldest outputs evicted first.
        """
        if max_depth < 2:
            raise ConfigError(f"suffix max_depth must be >= 2, got {max_depth}")
        if not 1 <= max_match < max_depth:
            raise ConfigError(f"suffix max_match must be in [1, max_depth={max_depth}), got {max_match}")
        if not alpha > 0:
            raise ConfigError(f"suffix alpha must be > 0, got {alpha}")
        if not 0.0 <= min_prob <= 1.0:
            raise ConfigError(f"suffix min_prob must be in [0, 1], got {min_prob}")
        if global_max_tokens < 0 or global_max_sequences < 0:
            raise ConfigError("suffix global_max_tokens and global_max_sequences must be >= 0 (0 turns it off)")
        self.max_depth = max_depth
        self.max_match = max_match
        self.alpha = alpha
        self.min_prob = min_prob
        self.global_max_tokens = global_max_tokens
        self.global_max_sequences = global_max_sequences
        # no child of share below min_prob is ever drafted, and at most 1 / min_prob children reach
        # that share: trees need keep only that many ranked children per node
        self.rank = int(1.0 / min_prob) + 1 if min_prob > 0 else 0
        self.global_tree = SuffixTree(max_depth, self.rank)
        self._next_global_key = 0
        self._states: dict[int, SuffixState] = {}

    # -- protocol -----------------------------------------------------------------------------

    def max_nodes(self, depth: int) -> int:
        """Drafts in a proposal of this depth at most. Twice the depth leaves room to branch; on
        the bench, more never changed tau (min_prob and alpha stop growth well before)."""
        return 2 * depth

    def start(self, seq_id: int, prompt: list[int], params: SamplingParams | None = None) -> None:
        """`params` is accepted and unused: the drafts do not depend on sampling."""
        tree = SuffixTree(self.max_depth, self.rank)
        tree.extend(LOCAL_KEY, prompt)
        self._states[seq_id] = SuffixState(tree, prompt_len=len(prompt))

    def propose(self, seq_id: int, tokens: list[int], budget: Budget) -> DraftTree:
        return self.scored_proposal(seq_id, tokens, budget)[0]

    def scored_proposal(self, seq_id: int, tokens: list[int], budget: Budget) -> tuple[DraftTree, float]:
        """The proposal and its score: the tokens it expects accepted if the counts were the
        truth (the sum of its node scores; 0 for no drafts)."""
        state = self._synced_state(seq_id, tokens)
        spec = self.speculation(state, budget)
        return spec_tree(tokens[-1], spec), spec.score

    def update(self, seq_id: int, result: VerifyResult, hidden: torch.Tensor | None = None) -> None:
        state = self._states.get(seq_id)
        if state is not None:  # an unknown sequence is started from `tokens` at its next proposal
            self._append(state, result.tokens)

    def finish(self, seq_id: int, tokens: list[int]) -> None:
        """Add the output (tokens after the prompt) to the global tree, evicting the oldest."""
        state = self._states.pop(seq_id, None)
        if state is None or self.global_max_tokens == 0 or self.global_max_sequences == 0:
            return
        output = tokens[state.prompt_len :][-self.global_max_tokens :]
        if not output:
            return
        tree = self.global_tree
        tree.extend(self._next_global_key, output)
        self._next_global_key += 1
        while tree.num_tokens > self.global_max_tokens or len(tree.sequences) > self.global_max_sequences:
            tree.remove(next(iter(tree.sequences)))  # dicts keep insertion order: oldest first

    # -- drafting -----------------------------------------------------------------------------

    def speculation(self, state: SuffixState, budget: Budget) -> Speculation:
        """The best-scoring speculation over both trees and a few match lengths.

        In each tree: the longest usable match m, then m // 2, m // 4, ... down to 1, stopping once
        a length's node cap (min(budget.nodes, alpha * length)) cannot beat the best score. A path
        stops below `min_prob` or below the budget's `min_confidence`, whichever is higher.
        """
        min_prob = max(self.min_prob, budget.min_confidence)
        best = Speculation()
        sources = (state.tree, state.tree.repeated_suffixes()), (self.global_tree, self._global_matches(state))
        for tree, matches in sources:
            usable = [(n, p) for n, p in matches if n <= self.max_match and has_continuation(p)]
            if not usable:
                continue
            by_length = dict(usable)  # every length below a usable match is usable too
            length = usable[0][0]
            while length >= 1:
                max_spec = min(budget.nodes, int(self.alpha * length))
                if max_spec <= best.score:
                    break  # shorter matches have lower caps still
                spec = speculate(tree.continuations, by_length[length], max_spec, budget.depth, min_prob)
                if spec.score > best.score:
                    best = spec
                length //= 2
        return best

    def _global_matches(self, state: SuffixState) -> list[tuple[int, Position]]:
        cursors = state.global_cursors
        if cursors.version != self.global_tree.version:
            cursors.version, cursors.cursors = self.global_tree.version, []
            self._step_global(cursors, state.tokens[-self.max_match :])
        return cursors.cursors

    def _step_global(self, cursors: GlobalCursors, new_tokens: list[int]) -> None:
        """Follow each committed token: extend the suffixes the global tree holds, start one."""
        for token in new_tokens:
            stepped: list[tuple[int, Position]] = []
            for length, position in cursors.cursors:
                if length < self.max_match:
                    child = step(position, token)
                    if child is not None:
                        stepped.append((length + 1, child))
            child = self.global_tree.root.children.get(token)
            if child is not None:
                stepped.append((1, child))
            cursors.cursors = stepped

    def _append(self, state: SuffixState, new_tokens: list[int]) -> None:
        state.tree.extend(LOCAL_KEY, new_tokens)
        if state.global_cursors.version == self.global_tree.version:
            self._step_global(state.global_cursors, new_tokens)
        # otherwise the cursors are stale anyway and are rebuilt at the next proposal

    def _synced_state(self, seq_id: int, tokens: list[int]) -> SuffixState:
        """The state for `tokens`: kept when it matches, extended when behind, rebuilt otherwise
        (keeping where its prompt ended)."""
        state = self._states.get(seq_id)
        if catch_up(state, tokens, self._append):
            return state
        prompt_len = state.prompt_len if state is not None else len(tokens)
        self.start(seq_id, tokens)
        self._states[seq_id].prompt_len = min(prompt_len, len(tokens))
        return self._states[seq_id]


def parse_argument(text: str) -> str:
    """Empty, or `local`: the per-request tree only, no global tree of finished outputs."""
    if text not in ("", "local"):
        raise ConfigError("suffix takes no argument, or `local` (the per-request tree only, no global tree "
                          "of earlier outputs)")
    return text


def build(argument: str, shape, target, target_path) -> SuffixDrafter:
    if argument != "local":
        return SuffixDrafter()
    drafter = SuffixDrafter(global_max_tokens=0)
    drafter.name = "suffix:local"
    return drafter


register(DrafterEntry("suffix", "suffix[:local]", SuffixDrafter.capabilities, build=build,
                      parse_argument=parse_argument))
