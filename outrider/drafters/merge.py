"""One speculation tree from a lexical drafter's tree and extra paths, under one node budget: what
Oilbird (its semantic neighbours), OoO-Spec (a sidecar's hint) and ToolSpec (a schema's skeleton)
add to suffix or n-gram trees. Each path keeps its best score; the best `max_nodes` paths are kept
with their parents.
"""

from __future__ import annotations

from .suffix import Speculation


def paths(tokens: list[int], parents: list[int]) -> set[tuple[int, ...]]:
    """Every node's path below the root (node i + 1 is tokens[i], child of tree node parents[i])."""
    out: list[tuple[int, ...]] = [()]
    for token, parent in zip(tokens, parents):
        out.append(out[parent] + (token,))
    return set(out[1:])


def merge(suffix: Speculation, semantic: list[tuple[tuple[int, ...], float]], max_nodes: int,
          min_prob: float) -> tuple[Speculation, int]:
    """One tree of at most `max_nodes` drafts from both: every path with its best score (the
    lexical tree's own score, such as suffix's count share, or the neighbours' share), best first,
    ties to the lexical tree and then to shallower paths; semantic paths below `min_prob` dropped.
    Returns it and how many of its nodes the lexical tree did not hold."""
    score: dict[tuple[int, ...], float] = {}
    order: dict[tuple[int, ...], int] = {}
    for path, s in zip(paths_in_order(suffix.tokens, suffix.parents), suffix.scores):
        score[path], order[path] = s, len(order)
    own = set(score)
    for path, s in sorted(semantic, key=lambda ps: len(ps[0])):
        if s < min_prob:
            continue
        if path not in score:
            order[path] = len(order)
        score[path] = max(score.get(path, 0.0), s)
    chosen = sorted(score, key=lambda p: (-score[p], order[p]))[:max_nodes]
    chosen.sort(key=lambda p: (len(p), order[p]))  # parents first
    index: dict[tuple[int, ...], int] = {(): 0}
    spec = Speculation()
    for path in chosen:
        if path[:-1] not in index:  # its parent lost to the budget (a tie broken the other way)
            continue
        index[path] = len(spec.tokens) + 1
        spec.tokens.append(path[-1])
        spec.parents.append(index[path[:-1]])
        spec.scores.append(score[path])
    return spec, sum(1 for p in index if p and p not in own)


def paths_in_order(tokens: list[int], parents: list[int]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for token, parent in zip(tokens, parents):
        out.append(out[parent] + (token,))
    return out[1:]


def accepted_beyond(committed: tuple[int, ...], own: set[tuple[int, ...]], added: set[tuple[int, ...]]) -> int:
    """Of a round's accepted tokens `committed`, how many only the added paths held: the depth of
    the accepted prefix among `added` less its depth among the lexical tree's own paths (0 when
    the tree held as much). OoO-Spec's and ToolSpec's counters of what their source gained."""
    m = h = 0
    while m < len(committed) and committed[: m + 1] in own:
        m += 1
    while h < len(committed) and committed[: h + 1] in added:
        h += 1
    return max(0, h - m)
