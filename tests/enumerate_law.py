"""Exact output laws by enumeration, for proving verifiers lossless on a tiny vocabulary.

`EnumeratingRandom` implements the verifiers' rng protocol (outrider/spec/random.py) by following
a **script**: the index of the branch to take at each draw. `enumerate_law(fn)` runs `fn(rng)`
once per script, depth first over every branch with positive probability, and adds up each
run's **weight** (the product of the probabilities of the branches it took) on its outcome. The
result is the exact law of `fn`'s outcome (up to float64 rounding), provided `fn` is
deterministic given its draws.

`EnumeratingUniforms` does the same with the draws keyed as PositionalRandom keys them (position,
stream, index): draws with one key share one uniform, so coupled drafting is enumerated exactly.

Worked example, fn = two fair coins, outcome = number of heads:
    scripts [0, 0] [0, 1] [1, 0] [1, 1]      (branch 0 is True/heads)
    weights  1/4    1/4    1/4    1/4     -> law {2: 1/4, 1: 1/2, 0: 1/4}
The next script is found by dropping trailing draws whose last branch was taken and moving the
draw before them to its next branch.

A **toy world** for whole generations: `ToyModel` maps a context (list of tokens) to logits
through a fixed random table indexed by its last two tokens; a target and a drafter are two
of them. `one_round` drafts a tree with a proposer, computes the target's logits at every
node from that node's context, verifies and returns the committed tokens. `generation_law`
composes exact round laws into the exact law of the first `length` generated tokens (rounds
depend only on the committed prefix, so round laws are memoised by prefix); `generate` is the
plain loop, whose law enumerated in one piece is the same (tested), only slower to compute.
`autoregressive_law` is the law plain sampling from p gives.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager
from typing import Callable, Hashable

import torch

from outrider.sampling import SamplingParams
from outrider.spec.random import ACCEPT, DRAFTING, TOKEN
from outrider.spec.types import DraftTree, VerifyResult
from outrider.spec.verify_chain import target_probs

Law = dict[Hashable, float]


class EnumeratingRandom:
    """The rng protocol, taking scripted branches and recording their probabilities."""

    def __init__(self, script: list[int]) -> None:
        self.script = script  # extended with branch 0 past its end
        self.options: list[int] = []  # number of branches at each draw so far
        self.weight = 1.0
        self.draws = 0

    def _branch(self, weights: list[float]) -> int:
        """Take the scripted branch among those with positive weight; return its index in `weights`."""
        live = [(i, w) for i, w in enumerate(weights) if w > 0.0]
        if self.draws == len(self.script):
            self.script.append(0)
        i, w = live[self.script[self.draws]]
        self.options.append(len(live))
        self.draws += 1
        self.weight *= w
        return i

    def uniform_below(self, prob: float, offset: int = 0, index: int = 0) -> bool:
        prob = min(max(float(prob), 0.0), 1.0)
        return self._branch([prob, 1.0 - prob]) == 0

    def uniform_below_rows(self, probs: torch.Tensor, offsets: torch.Tensor | None = None) -> torch.Tensor:
        return torch.tensor([self.uniform_below(p) for p in probs.tolist()], dtype=torch.bool)

    def categorical(self, probs: torch.Tensor, offset: int = 0, index: int = 0) -> int:
        probs = probs.double()
        return self._branch((probs / probs.sum()).tolist())

    def categorical_rows(self, probs: torch.Tensor, offsets: torch.Tensor | None = None) -> torch.Tensor:
        return torch.tensor([self.categorical(row) for row in probs], dtype=torch.long)

    # every call is its own independent draw here, whatever its position: views are the rng itself
    def at(self, first: int) -> "EnumeratingRandom":
        return self

    def drafting(self) -> "EnumeratingRandom":
        return self


class EnumeratingUniforms:
    """The rng protocol with PositionalRandom's keys: the uniform behind a draw is that of
    (absolute position, stream, index), so draws with one key share one uniform, as a coupled
    drafter's draft and the walk's token do (spec/random.py; drafters/capabilities.py `couples`).

    What is known of a key's uniform is an interval, [0, 1) before its first draw. A draw cuts
    [0, 1) at its thresholds (a categorical: its inverse-CDF buckets, token i covering
    [cdf[i-1], cdf[i]) as `categorical_from_uniform` draws; uniform_below(prob): [0, prob) for
    True), takes the scripted piece among those meeting the interval, with weight its share of
    the interval, and narrows the interval to it. So the enumeration is exact for any sharing
    of uniforms between draws, and reduces to EnumeratingRandom when no key is drawn twice.

    Worked example, two categoricals on one key, p = [0.5, 0.5] then q = [0.25, 0.75]:
        p's buckets [0, .5) [.5, 1); q's [0, .25) [.25, 1)
        (0, 0): .25    (0, 1): .25    (1, 1): .5    (1, 0): 0 (never taken)
    """

    def __init__(self, script: list[int], first: int = 0, stream_base: int = 0, tape: dict | None = None) -> None:
        self.first, self.stream_base = first, stream_base
        self.tape = tape if tape is not None else {"script": script, "options": [], "weight": 1.0, "draws": 0,
                                                   "known": {}}

    # what _enumerate reads
    script = property(lambda self: self.tape["script"])
    options = property(lambda self: self.tape["options"])
    weight = property(lambda self: self.tape["weight"])
    draws = property(lambda self: self.tape["draws"])

    def _draw(self, cuts: list[float], offset: int, stream: int, index: int) -> int:
        """Piece i of [0, 1) is [cuts[i], cuts[i + 1]); returns the piece taken."""
        tape = self.tape
        key = (self.first + offset, self.stream_base + stream, index)
        lo, hi = tape["known"].get(key, (0.0, 1.0))
        parts = [(max(lo, a), min(hi, b)) for a, b in zip(cuts[:-1], cuts[1:])]
        live = [(i, (b - a) / (hi - lo)) for i, (a, b) in enumerate(parts) if b > a]
        if tape["draws"] == len(tape["script"]):
            tape["script"].append(0)
        i, w = live[tape["script"][tape["draws"]]]
        tape["options"].append(len(live))
        tape["draws"] += 1
        tape["weight"] *= w
        tape["known"][key] = parts[i]
        return i

    def uniform_below(self, prob: float, offset: int = 0, index: int = 0) -> bool:
        prob = min(max(float(prob), 0.0), 1.0)
        return self._draw([0.0, prob, 1.0], offset, ACCEPT, index) == 0

    def uniform_below_rows(self, probs: torch.Tensor, offsets: torch.Tensor | None = None) -> torch.Tensor:
        offsets = [0] * len(probs) if offsets is None else offsets.tolist()
        return torch.tensor([self.uniform_below(p, o) for p, o in zip(probs.tolist(), offsets)], dtype=torch.bool)

    def categorical(self, probs: torch.Tensor, offset: int = 0, index: int = 0) -> int:
        return self._draw(_buckets(tuple(probs.double().tolist())), offset, TOKEN, index)

    def categorical_rows(self, probs: torch.Tensor, offsets: torch.Tensor | None = None) -> torch.Tensor:
        rows = probs.double().tolist()  # [n][vocab]
        offsets = [0] * len(rows) if offsets is None else offsets.tolist()
        return torch.tensor([self._draw(_buckets(tuple(row)), o, TOKEN, 0) for row, o in zip(rows, offsets)],
                            dtype=torch.long)

    def at(self, first: int) -> "EnumeratingUniforms":
        return EnumeratingUniforms([], first, self.stream_base, self.tape)

    def drafting(self) -> "EnumeratingUniforms":
        return EnumeratingUniforms([], self.first, self.stream_base + DRAFTING, self.tape)


_BUCKETS: dict[tuple[float, ...], list[float]] = {}


def _buckets(probs: tuple[float, ...]) -> list[float]:
    """The cuts of a categorical draw from `probs` (float64 values): [0, cdf[0], ..., 1], token i
    covering [cdf[i-1], cdf[i]). Memoised by value: an enumeration draws from the same few rows
    many thousands of times (one whole run per branch), and the cuts are a function of the values."""
    cuts = _BUCKETS.get(probs)
    if cuts is None:
        if len(_BUCKETS) > 100_000:
            _BUCKETS.clear()
        row = torch.tensor(probs, dtype=torch.float64)
        row = row / row.sum()  # [vocab]
        cdf = row.cumsum(0)
        last = int(torch.nonzero(row > 0).max())
        cdf[last:] = 1.0  # the last token of positive mass takes what rounding leaves, as categorical_from_uniform
        cuts = _BUCKETS[probs] = [0.0, *cdf.tolist()]
    return cuts


@contextmanager
def one_thread():
    """Tiny tensors gain nothing from intra-op threads, and on a loaded machine waking the
    thread pool per op costs milliseconds: enumerations run single-threaded."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def enumerate_law(fn: Callable[[EnumeratingRandom], Hashable], make=EnumeratingRandom) -> Law:
    """The exact law of fn(rng)'s outcome over every branch of every draw; `make(script)` builds
    the rng (EnumeratingUniforms: draws keyed as PositionalRandom keys them share their uniform)."""
    with one_thread():
        return _enumerate(fn, make)


def _enumerate(fn: Callable[[EnumeratingRandom], Hashable], make=EnumeratingRandom) -> Law:
    law: Law = defaultdict(float)
    script: list[int] = []
    while True:
        rng = make(script)
        outcome = fn(rng)
        assert rng.draws == len(script), "fn made fewer draws than its script: not deterministic given its draws"
        law[outcome] += rng.weight
        while script and script[-1] + 1 == rng.options[len(script) - 1]:
            script.pop()
        if not script:
            return dict(law)
        script[-1] += 1


def max_law_difference(a: Law, b: Law) -> float:
    return max(abs(a.get(key, 0.0) - b.get(key, 0.0)) for key in set(a) | set(b))


# --- the toy world -------------------------------------------------------------------------


class ToyModel:
    """context (list of tokens) -> logits [vocab] float64, from a table indexed by the last two tokens."""

    def __init__(self, vocab: int, seed: int, scale: float = 1.5, banned: int | None = None) -> None:
        """`banned`: a token given probability 0 in every context (a drafter with a blind spot)."""
        gen = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        table = torch.randn(vocab, vocab, vocab, generator=gen, dtype=torch.float64) * scale  # [V, V, V]
        if banned is not None:
            table[..., banned] = float("-inf")
        self.table = {(a, b): table[a, b] for a in range(vocab) for b in range(vocab)}
        self.softmax = {key: torch.softmax(row, -1) for key, row in self.table.items()}

    def logits(self, context: list[int]) -> torch.Tensor:
        return self.table[context[-2], context[-1]]  # [vocab]

    def probs(self, context: list[int]) -> torch.Tensor:
        return self.softmax[context[-2], context[-1]]  # [vocab]


def node_contexts(committed: list[int], tokens: list[int], parents: list[int]) -> list[list[int]]:
    """The context after each node: committed tokens (ending with the root) plus the path below the root."""
    contexts = [list(committed)]
    for i in range(1, len(tokens)):
        contexts.append(contexts[parents[i]] + [tokens[i]])
    return contexts


# A proposer drafts one round's tree: (committed tokens, rng) -> DraftTree rooted at committed[-1].
Proposer = Callable[[list[int], EnumeratingRandom], DraftTree]
Verifier = Callable[[DraftTree, torch.Tensor, SamplingParams, object], VerifyResult]


def sampled_tree(drafter: ToyModel, widths: list[int], without_replacement: bool, probs: bool = True) -> Proposer:
    """Every node at depth d gets widths[d] children drawn from q (its drafter distribution).

    widths [1, 1, 1] is a chain of 3 drafts; [2, 1] a root with 2 siblings, each with one child.
    `probs=False` drops draft_probs (for verifiers that must not need them).
    """

    def propose(committed: list[int], rng: EnumeratingRandom) -> DraftTree:
        tokens, parents, rows = [committed[-1]], [-1], []
        frontier = [(0, list(committed))]
        draws = rng.drafting()  # the drafter's own streams (a positional rng: apart from the verifier's)
        for depth, width in enumerate(widths):
            next_frontier = []
            for node, context in frontier:
                q = drafter.probs(context)  # [vocab]
                left = q.clone()
                for j in range(width):
                    x = draws.categorical(left, offset=depth, index=j)
                    if without_replacement:
                        left[x] = 0.0
                    tokens.append(x)
                    parents.append(node)
                    next_frontier.append((len(tokens) - 1, context + [x]))
            frontier = next_frontier
        contexts = node_contexts(committed, tokens, parents)
        draft_probs = torch.stack([drafter.probs(c) for c in contexts]) if probs else None  # [n, vocab]
        return DraftTree(torch.tensor(tokens), torch.tensor(parents), draft_probs)

    return propose


def fixed_tree(parents: list[int], pick: Callable[[list[int], int], int]) -> Proposer:
    """A deterministic tree: node i's token is pick(context of its parent, i). No draft_probs."""

    def propose(committed: list[int], rng: EnumeratingRandom) -> DraftTree:
        tokens = [committed[-1]]
        contexts = [list(committed)]
        for i in range(1, len(parents)):
            tokens.append(pick(contexts[parents[i]], i))
            contexts.append(contexts[parents[i]] + [tokens[i]])
        return DraftTree(torch.tensor(tokens), torch.tensor(parents))

    return propose


def target_logits(committed: list[int], tree: DraftTree, target: ToyModel) -> torch.Tensor:
    """The verify forward's output: the target's logits after every node. -> [n, vocab]"""
    contexts = node_contexts(committed, tree.tokens.tolist(), tree.parents.tolist())
    return torch.stack([target.logits(c) for c in contexts])


def one_round(
    committed: list[int], rng, target: ToyModel, propose: Proposer, verify: Verifier, params: SamplingParams
) -> list[int]:
    """Draft, compute the target's logits at every node, verify: the tokens this round commits."""
    rng = rng.at(len(committed))  # offset 0: the first token this round commits
    tree = propose(committed, rng)
    result = verify(tree, target_logits(committed, tree, target), params, rng)
    assert len(result.tokens) == result.num_accepted + 1
    return result.tokens


def generate(
    prompt: list[int], length: int, rng, target: ToyModel, propose: Proposer, verify: Verifier, params: SamplingParams
) -> tuple[int, ...]:
    """A whole generation loop: rounds until `length` tokens are committed (the last round truncated)."""
    committed = list(prompt)
    while len(committed) < len(prompt) + length:
        committed += one_round(committed, rng, target, propose, verify, params)
    return tuple(committed[len(prompt) : len(prompt) + length])


def generation_law(
    prompt: list[int], length: int, target: ToyModel, propose: Proposer, verify: Verifier, params: SamplingParams
) -> Law:
    """The exact law of `generate`'s output, composed from exact round laws memoised by prefix.

    A round's law is composed too: the law of the drafted tree, then for each tree the law of
    its verification (the draws are independent, so this is `one_round`'s law; it saves
    redrafting for every verification branch). The proposer must be deterministic given its
    draws, so that a tree's tokens and parents determine it.
    """
    round_laws: dict[tuple[int, ...], Law] = {}

    def round_law(committed: tuple[int, ...]) -> Law:
        if committed not in round_laws:
            trees: dict[tuple, DraftTree] = {}

            def draft(rng: EnumeratingRandom) -> tuple:
                tree = propose(list(committed), rng)
                key = (tuple(tree.tokens.tolist()), tuple(tree.parents.tolist()))
                trees[key] = tree
                return key

            law: Law = defaultdict(float)
            for key, tree_weight in enumerate_law(draft).items():
                tree = trees[key]
                logits = target_logits(list(committed), tree, target)
                verified = enumerate_law(lambda rng: tuple(verify(tree, logits, params, rng).tokens))
                for tokens, weight in verified.items():
                    law[tokens] += tree_weight * weight
            round_laws[committed] = law
        return round_laws[committed]

    def law_from(committed: tuple[int, ...], remaining: int) -> Law:
        law: Law = defaultdict(float)
        for tokens, weight in round_law(committed).items():
            if len(tokens) >= remaining:
                law[tokens[:remaining]] += weight
                continue
            for rest, rest_weight in law_from(committed + tokens, remaining - len(tokens)).items():
                law[tokens + rest] += weight * rest_weight
        return law

    return dict(law_from(tuple(prompt), length))


def autoregressive_law(prompt: list[int], length: int, target: ToyModel, params: SamplingParams) -> Law:
    """The law of `length` tokens sampled one by one from p (the verifiers' target_probs)."""
    law: Law = {(): 1.0}
    for _ in range(length):
        longer: Law = {}
        for seq, weight in law.items():
            p = target_probs(target.logits(list(prompt) + list(seq)), params).tolist()
            for y, py in enumerate(p):
                if py > 0.0:
                    longer[seq + (y,)] = weight * py
        law = longer
    return law
