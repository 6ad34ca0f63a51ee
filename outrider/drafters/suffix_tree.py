"""A suffix trie with counts over windows of at most `max_depth` tokens, grown as tokens arrive.

Every position `s` of a stored sequence starts a **window**: the tokens `seq[s : s + max_depth]`
(shorter at the end of the sequence). The trie holds every window as a path from the root, and
each node counts the windows that pass through it, so for a path `w`

    count(w) = #{(sequence, s) : seq[s : s + len(w)] == w},   len(w) <= max_depth

and `count(w + [t]) / sum over t' of count(w + [t'])` is how often `t` followed `w`.

Worked example (max_depth 3, one sequence `a b a b`): windows `aba`, `bab`, `ab`, `b`:

    root(4) -a(2)-b(2)-a(1)          count(a b) = 2: positions 0 and 2
            -b(2)-a(1)-b(1)          after `b`, `a` followed once; the window `b` at 3 ended
                                     there (the end of the sequence), it says nothing about
                                     what follows

**Leaves keep memory small.** A plain trie stores up to `max_depth` nodes per position, nearly
all of them on paths that one window alone passes through. Here such a path is not stored node by
node: the first node that only one window reaches is a `Leaf` that points into that window's
sequence (`seq`, the index `pos` of the token after the leaf, and the window's end). Everything
below it is read from the sequence, so a growing sequence grows its leaves for free. When a
second window arrives at a leaf, the leaf is **split**: it becomes a `Node` and the first
window's continuation becomes a leaf one token further down. On Python source (word tokens,
max_depth 32) this stores about 1.8 nodes and 1 leaf per token, some 650 bytes per token.

**Appending a token** extends the windows still walking through shared nodes (the *walkers*: the
suffixes of the growing sequence that occurred before) and starts one new window at the root.
A walker that reaches a missing child leaves a `Leaf` and stops; one that reaches `max_depth`
stops. So a token costs one step per walker: as many as its longest repeated suffix is long,
at most `max_depth`.

**Reading children** (`continuations`) uses each node's `total` (the sum of its children's
counts, kept as counts change) and, with `rank`, a list of its `rank` most frequent children,
kept as counts grow (a child that passes the lowest member replaces it) and rebuilt after a
removal. A drafter that keeps only children of share >= p loses nothing with rank > 1 / p, and
never scans the thousands of children of a node such as "after a newline".

One sequence at a time may grow (the last one extended): a split then always finds the first
window's next token already stored (it started earlier in the same sequence, or its sequence is
complete). The per-request tree grows one sequence; the global tree adds whole sequences.

**Removing a sequence** walks each of its windows, decrementing counts and deleting what falls
to zero; a leaf on the way is always the window's own. Counts stay exact (the tests compare them
with a brute-force count). Nodes left with a count of 1 are not folded back into leaves.
"""

from __future__ import annotations

import heapq


class Node:
    """A path that more than one window reached (or the root): its counts and children."""

    __slots__ = ("count", "total", "children", "top", "floor")

    def __init__(self, count: int = 0):
        self.count = count  # windows through this node
        self.total = 0  # windows through its children: count minus the windows that end here
        self.children: dict[int, Node | Leaf] = {}
        self.top: list[int] | None = None  # the `rank` most frequent children; None: to rebuild
        self.floor = 0  # at most the lowest count in `top`


class Leaf:
    """A path one window alone reached; what follows is `seq[pos : min(end, len(seq))]`.

    Also serves as a read position inside such a path (count 1 throughout).
    """

    __slots__ = ("seq", "pos", "end")
    count = 1

    def __init__(self, seq: list[int], pos: int, end: int):
        self.seq = seq  # the window's sequence (the tree's own list, which may still grow)
        self.pos = pos  # index of the token after this node
        self.end = end  # the window's end: its start + max_depth


Position = Node | Leaf
Continuations = tuple[int, list[tuple[int, int, Position]]]  # (total, [(token, count, child), ...])


def step(position: Position, token: int) -> Position | None:
    """The node reached from `position` by `token`, or None when no window continues so."""
    if type(position) is Node:
        return position.children.get(token)
    if position.pos < min(position.end, len(position.seq)) and position.seq[position.pos] == token:
        return Leaf(position.seq, position.pos + 1, position.end)
    return None


def has_continuation(position: Position) -> bool:
    if type(position) is Node:
        return bool(position.children)
    return position.pos < min(position.end, len(position.seq))


class SuffixTree:
    """Counted windows of the stored sequences; sequences are added, extended and removed by key.

    `rank` (0: all) limits `continuations` to the `rank` most frequent children of a node, kept up
    to date as counts grow, so that drafting never scans a node with thousands of children. A
    reader that only wants children of frequency >= p loses nothing with rank > 1 / p.
    """

    def __init__(self, max_depth: int, rank: int = 0):
        self.max_depth = max_depth
        self.rank = rank
        self.root = Node()  # root.count == number of windows == stored tokens
        self.sequences: dict[int, list[int]] = {}  # key -> tokens, oldest first (read only)
        self.version = 0  # bumped by every change; read positions from an older version are stale
        self._growing: int | None = None  # the key that may be extended
        self._walkers: list[tuple[int, Node]] = []  # (window start, node), oldest first

    @property
    def num_tokens(self) -> int:
        return self.root.count

    def extend(self, key: int, tokens: list[int]) -> None:
        """Append tokens to sequence `key` (a new key starts a new sequence)."""
        seq = self.sequences.get(key)
        if seq is None:
            seq = self.sequences[key] = []
            self._growing, self._walkers = key, []
        elif key != self._growing:
            raise RuntimeError(f"suffix tree: only the last sequence extended may grow, not {key}")
        self.version += 1
        max_depth = self.max_depth
        for token in tokens:
            at = len(seq)
            seq.append(token)
            self.root.count += 1
            walkers = self._walkers
            walkers.append((at, self.root))
            still_walking: list[tuple[int, Node]] = []
            for start, node in walkers:
                node.total += 1
                child = node.children.get(token)
                if child is None:  # this window is unique from here on
                    node.children[token] = Leaf(seq, at + 1, start + max_depth)
                    continue
                if type(child) is Leaf:
                    child = self._split(node, token, child)
                child.count += 1
                if node.top is not None and child.count > node.floor and token not in node.top:
                    self._promote(node, token)
                if at + 1 - start < max_depth:
                    still_walking.append((start, child))
            self._walkers = still_walking

    def repeated_suffixes(self) -> list[tuple[int, Node]]:
        """(length, node) of each suffix of the growing sequence seen before in the tree, longest
        first. They are contiguous: a suffix seen before has all its shorter suffixes seen."""
        seq = self.sequences.get(self._growing, [])
        return [(len(seq) - start, node) for start, node in self._walkers]

    def remove(self, key: int) -> None:
        """Forget sequence `key`: every window it started leaves the counts."""
        seq = self.sequences.pop(key)
        if key == self._growing:
            self._growing, self._walkers = None, []
        self.version += 1
        for start in range(len(seq)):
            self.root.count -= 1
            node = self.root
            for at in range(start, min(start + self.max_depth, len(seq))):
                node.total -= 1
                node.top = None  # a count fell: rebuilt when next read
                child = node.children[seq[at]]
                if type(child) is Leaf:  # only this window reached it
                    assert child.seq is seq and child.pos == at + 1, "suffix tree: leaf of another window"
                    del node.children[seq[at]]
                    break
                child.count -= 1
                if child.count == 0:  # nothing else below either
                    del node.children[seq[at]]
                    break
                node = child

    def continuations(self, position: Position, min_share: float = 0.0) -> Continuations:
        """(total, [(token, count, child), ...]): the tokens seen after `position` whose count is
        at least `min_share * total`, where total sums the counts of all of them. With `rank`, only
        the `rank` most frequent are considered (all that can reach a share above 1 / rank)."""
        if type(position) is Node:
            children, total = position.children, position.total
            need = min_share * total
            if self.rank and len(children) > self.rank:
                top = position.top
                if top is None:
                    top = position.top = heapq.nlargest(self.rank, children, key=lambda t: children[t].count)
                    position.floor = children[top[-1]].count
                options = [(t, children[t].count, children[t]) for t in top]
                return total, [o for o in options if o[1] >= need]
            return total, [(t, c.count, c) for t, c in children.items() if c.count >= need]
        if position.pos < min(position.end, len(position.seq)):
            return 1, [(position.seq[position.pos], 1, Leaf(position.seq, position.pos + 1, position.end))]
        return 0, []

    def find(self, path: list[int]) -> Position | None:
        """The node of `path` (from the root), or None when no window starts with it."""
        position: Position | None = self.root
        for token in path:
            position = step(position, token)
            if position is None:
                return None
        return position

    def counts(self) -> dict[tuple[int, ...], int]:
        """Every stored path with its count, leaves unrolled (slow: for tests and reports)."""
        out: dict[tuple[int, ...], int] = {}
        stack: list[tuple[tuple[int, ...], Position]] = [((), self.root)]
        while stack:
            path, position = stack.pop()
            for token, count, child in self._all_children(position):
                out[path + (token,)] = count
                stack.append((path + (token,), child))
        return out

    def num_nodes(self) -> tuple[int, int]:
        """(nodes, leaves) stored (slow: for reports)."""
        nodes = leaves = 0
        stack: list[Node] = [self.root]
        while stack:
            node = stack.pop()
            nodes += 1
            for child in node.children.values():
                if type(child) is Node:
                    stack.append(child)
                else:
                    leaves += 1
        return nodes, leaves

    def _all_children(self, position: Position) -> list[tuple[int, int, Position]]:
        if type(position) is Node:
            return [(t, c.count, c) for t, c in position.children.items()]
        return self.continuations(position)[1]

    def _promote(self, node: Node, token: int) -> None:
        """`token`'s count passed the floor of `node.top`: swap it for the lowest, if it is lower."""
        top, children = node.top, node.children
        low = min(range(len(top)), key=lambda i: children[top[i]].count)
        if children[token].count > children[top[low]].count:
            top[low] = token
        node.floor = min(children[t].count for t in top)

    def _split(self, parent: Node, token: int, leaf: Leaf) -> Node:
        """A second window reached `leaf`: store it as a node holding the first window's rest."""
        node = Node(count=1)
        if leaf.pos < min(leaf.end, len(leaf.seq)):
            node.children[leaf.seq[leaf.pos]] = Leaf(leaf.seq, leaf.pos + 1, leaf.end)
            node.total = 1
        parent.children[token] = node
        return node
