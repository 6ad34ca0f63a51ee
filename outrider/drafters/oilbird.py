"""`--drafter oilbird[:K[,SIM[,MB]][,base=BASE]]`: a lexical pool drafter with a second, semantic key over its pool.

Lexical pool drafters (suffix trees, n-grams) find a continuation only where the last tokens
match the pool exactly. Right after a token the pool has never seen in that place (a freshly
minted id, a new number in a repeated tool call) the longest match is a token or two, and the
suffix drafter drafts little or nothing, although the rest of the call is in the pool.

Oilbird (issue 26, item 1) keys the same pool a second time, by the target's hidden state at each
pool position, which the verify forward computes anyway (the drafter declares the target's last
layer in `needs_hidden`: no extra pass). A key is the last layer's output at a position, scaled as
the target's final norm scales it, cut to `DIMS` dimensions by a fixed random projection, made a
unit vector and stored in float16, with the token that followed it:

    position p:  key(p) = unit(P @ (rmsnorm(h_p) * w_norm))      next(p) = token p + 1

Each round, the query is the key of the last position with a hidden state: the one that predicted
the root (the root's own state comes with this round's verify). The K stored keys nearest to it in
cosine, among those at least SIM alike whose next token *is* the root (a neighbour that predicted
what the target just committed), give their continuations, the tokens after their next token,
up to the round's depth. The continuations make a small trie in which a node's score is the share
of the neighbours passing through it; the base drafter's speculation (by default suffix.py's, its
scores the count shares along each path; see BASE below) and that trie are merged into one tree of
at most the round's node budget, best score first (a node both propose keeps the higher score;
scores never grow along a path, so a parent is always taken before its children). The scores become the tree's confidence.

The pool is the base drafter's: per request, the prompt and output so far (the prompt's keys
come from the prefill forward); across requests, with suffix's global tree, the outputs of
finished ones. Its keys hold at most MB megabytes in all (2 * DIMS + 4 bytes a position): the
oldest finished output is evicted first, then a running request's oldest positions.
`memory_bytes()` and `stats()` report it, with the rounds where the base's speculation missed
(its tree held no node for the token the target committed at the first position it did not
accept, within the round's depth) and, of those, the ones where the semantic lookup had proposed
that token on the committed path: the share of the base's misses that were in the pool.

The drafts are chosen from the pool and the target's own states and verified like any suffix
tree (greedy: the greedy tree verifier; sampling: the tree walk), so the output is the target's
whatever is drafted.

BASE, the lexical drafter whose pool is keyed a second time and whose tree the lookup merges into
(`base=`, default suffix), is one of three exact-match pool drafters, each unchanged:

- `suffix` (suffix.py): per-request and global suffix trees; its nodes scored by count shares;
  node budget 2 * depth; the semantic pool holds finished outputs too, as its global tree does.
- `ngram` (ngram.py, prompt lookup): the chain that followed the latest earlier occurrence of the
  last n-gram (n from 3 down to 1) in the request's own text; every node of it scored n / 3 (the
  drafter has no counts: a 3-gram match outranks every neighbour share, a 1-gram one outranks only
  shares below 1/3); node budget depth, a chain's; no pool across requests, so no global keys either.
- `suffix:local` (`--drafter suffix:local`): the suffix drafter without its global tree, the
  request's own text its whole pool; budget and scores as suffix; no global keys.

So a base and its Oilbird have the same pool and the same node budget: only the second key differs.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import ConfigError
from ..sampling import SamplingParams
from ..spec.types import Budget, DraftTree, VerifyResult
from .base import DrafterBase, missing_tail
from .capabilities import Capabilities
from .merge import merge, paths
from .oilbird_base import BASE, BASES, MB, SIM, K, OilbirdArgument, make_base, parse_argument  # noqa: F401 (tests)
from .registry import DrafterEntry, register
from .suffix import SuffixDrafter, spec_tree

DIMS = 64  # key dimensions after the random projection
PROJECTION_SEED = 0x0171B12D


class KeyRows:
    """Keys of consecutive pool positions: row r holds the key of a position and the token that
    followed it (`nexts[r]`), so the continuation after that token is nexts[r + 1:]."""

    def __init__(self, dims: int):
        self.keys = torch.empty(0, dims, dtype=torch.float16)  # [n, D] unit vectors
        self.nexts = torch.empty(0, dtype=torch.int32)  # [n]

    @property
    def rows(self) -> int:
        return self.nexts.shape[0]

    @property
    def nbytes(self) -> int:
        return self.keys.nelement() * self.keys.element_size() + self.nexts.nelement() * self.nexts.element_size()

    def append(self, keys: torch.Tensor, nexts: list[int]) -> None:
        self.keys = torch.cat((self.keys, keys))
        self.nexts = torch.cat((self.nexts, torch.tensor(nexts, dtype=torch.int32)))

    def drop_front(self, n: int) -> None:
        self.keys, self.nexts = self.keys[n:].clone(), self.nexts[n:].clone()  # clone: free the old rows


@dataclass
class Own:
    """One request's keys: row r is position first + r; rows == len(tokens) - 1 - first in step."""

    rows: KeyRows
    tokens: list[int]  # committed so far
    first: int = 0
    prompt_len: int = 0
    base_paths: set = field(default_factory=set)  # this round's proposals, for stats
    semantic_paths: set = field(default_factory=set)
    depth: int = 0


@dataclass
class Stats:
    rounds: int = 0
    lookups: int = 0  # rounds whose lookup found at least one neighbour
    base_misses: int = 0  # rounds where the base's tree lacked the target's token (within the depth)
    semantic_present: int = 0  # ... and the semantic lookup had proposed it
    semantic_drafted: int = 0  # draft nodes that came from the semantic trie alone
    semantic_accepted: int = 0  # accepted tokens beyond what the base's tree alone held


class OilbirdDrafter(DrafterBase):
    """A lexical base's speculation merged with the continuations of the nearest hidden states."""

    name = "oilbird"
    trees = SuffixDrafter.capabilities.trees

    def __init__(self, layer: int, k: int = K, sim: float = SIM, mb: float = MB, hidden_size: int | None = None,
                 norm_weight: torch.Tensor | None = None, eps: float = 1e-5, dims: int = DIMS, base: str = BASE):
        """layer: the target layer whose output keys a position (declared in needs_hidden);
        norm_weight, eps: the target's final norm, applied before the projection (None: none);
        hidden_size: the target's (None: taken from the first states seen, projected when above dims);
        base: the lexical drafter (one of BASES)."""
        if not 1 <= k <= 64 or not 0.0 < sim <= 1.0 or not mb > 0:
            raise ConfigError(f"oilbird takes 1 <= k <= 64, 0 < sim <= 1 and mb > 0, got {k}, {sim}, {mb}")
        self.base, self.base_name = make_base(base), base
        self.min_prob = self.base.min_prob
        self.capabilities = Capabilities(trees=self.trees, needs_hidden=(layer,))
        self.layer, self.k, self.sim = layer, k, sim
        self.max_bytes = int(mb * 2**20)
        self.dims = dims
        self.norm_weight = None if norm_weight is None else norm_weight.detach().float().cpu()
        self.eps = eps
        self._projection: torch.Tensor | None = None  # [E, D] or None for E <= D
        if hidden_size is not None:
            self._projection_for(hidden_size)
        self.global_rows = KeyRows(dims)
        self.global_ends: list[int] = []  # cumulative row ends of the finished outputs, oldest first
        self.global_lengths: deque[int] = deque()
        self.global_valid = torch.empty(0, dtype=torch.bool)  # rows with a continuation in their output
        self.counts = Stats()
        self._own: dict[int, Own] = {}

    # -- keys -------------------------------------------------------------------------------------
    def _projection_for(self, size: int) -> torch.Tensor | None:
        if self._projection is None and size > self.dims:
            generator = torch.Generator().manual_seed(PROJECTION_SEED)
            self._projection = torch.randn(size, self.dims, generator=generator) / self.dims**0.5
        return self._projection

    def keys(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, E] (or [n, 1, E]) target states -> [n, D] float16 unit keys."""
        h = hidden.reshape(hidden.shape[0], -1).float().cpu()
        if self.norm_weight is not None:
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm_weight
        projection = self._projection_for(h.shape[1])
        if projection is not None:
            h = h @ projection
        elif h.shape[1] < self.dims:
            h = torch.nn.functional.pad(h, (0, self.dims - h.shape[1]))
        return torch.nn.functional.normalize(h, dim=-1).to(torch.float16)

    def _zeros(self, n: int) -> torch.Tensor:
        return torch.zeros(n, self.dims, dtype=torch.float16)  # never within a positive floor

    # -- protocol -----------------------------------------------------------------------------
    def max_nodes(self, depth: int) -> int:
        """The base's budget: the merged tree is never larger than the base's own may be."""
        return self.base.drafter.max_nodes(depth)

    def start(self, seq_id: int, prompt: list[int], params: SamplingParams | None = None,
              hidden: torch.Tensor | None = None) -> None:
        """hidden: [len(prompt) - 1, 1, E] the prompt's states at the declared layer (None: no keys
        for the prompt, as for a one-token prompt or a state rebuilt from tokens alone)."""
        self.base.drafter.start(seq_id, prompt, params)
        own = Own(KeyRows(self.dims), list(prompt), prompt_len=len(prompt))
        n = len(prompt) - 1
        if n > 0:
            keys = self.keys(hidden) if hidden is not None and hidden.shape[0] == n else self._zeros(n)
            own.rows.append(keys, prompt[1:])
        self._own[seq_id] = own
        self._bound(own)

    def update(self, seq_id: int, result: VerifyResult, hidden: torch.Tensor | None = None) -> None:
        """hidden: [1 + num_accepted, 1, E] the states of the root and the accepted drafts."""
        self.base.drafter.update(seq_id, result)
        own = self._own.get(seq_id)
        if own is None:
            return
        self._count(own, result)
        self._sync(own, own.tokens)  # positions behind (a round not followed) get blank keys
        new = list(result.tokens)
        own.tokens += new
        if not new:
            return
        keys = self._zeros(len(new))
        if hidden is not None:
            got = self.keys(hidden[: len(new)])
            keys[: got.shape[0]] = got
        own.rows.append(keys, new)
        self._bound(own)

    def finish(self, seq_id: int, tokens: list[int]) -> None:
        """The output's keys join the global pool (from the last prompt position on), oldest evicted."""
        own = self._own.pop(seq_id, None)
        prompt_len = own.prompt_len if own is not None else 0
        self.base.drafter.finish(seq_id, tokens)
        if own is None or not self.base.global_pool:
            return
        start = max(prompt_len - 1 - own.first, 0)
        end = len(tokens) - 1 - own.first  # a round cut by a stop committed fewer tokens than it followed
        keys, nexts = own.rows.keys[start:end], own.rows.nexts[start:end]
        if nexts.tolist() != tokens[own.first + start + 1: own.first + end + 1]:
            return  # not the tokens this request followed
        n = nexts.shape[0]
        if n < 2:
            return
        rows = self.global_rows
        rows.keys, rows.nexts = torch.cat((rows.keys, keys)), torch.cat((rows.nexts, nexts))
        valid = torch.ones(n, dtype=torch.bool)
        valid[-1] = False  # its next token ends the output: nothing after it
        self.global_valid = torch.cat((self.global_valid, valid))
        self.global_lengths.append(n)
        self._ends()
        self._bound(None)

    def propose(self, seq_id: int, tokens: list[int], budget: Budget) -> DraftTree:
        return self.scored_proposal(seq_id, tokens, budget)[0]

    def scored_proposal(self, seq_id: int, tokens: list[int], budget: Budget) -> tuple[DraftTree, float]:
        own = self._own.get(seq_id)
        tail = missing_tail(own.tokens, tokens) if own is not None else None
        if tail is None:  # unknown, or another prefix: no keys for what came before (as the base rebuilds)
            prompt_len = min(own.prompt_len, len(tokens)) if own is not None else len(tokens)
            own = self._own[seq_id] = Own(KeyRows(self.dims), list(tokens), len(tokens) - 1, prompt_len)
        else:
            own.tokens += tail
        self._sync(own, tokens)
        lexical = self.base.speculation(seq_id, tokens, budget)
        min_prob = max(self.min_prob, budget.min_confidence)
        semantic = self.lookup(own, tokens[-1], budget.depth)
        spec, from_semantic = merge(lexical, semantic, budget.nodes, min_prob)
        self.counts.semantic_drafted += from_semantic
        own.base_paths = paths(lexical.tokens, lexical.parents)
        own.semantic_paths = {path for path, _ in semantic}
        own.depth = budget.depth
        return spec_tree(tokens[-1], spec), spec.score

    # -- the semantic lookup ----------------------------------------------------------------------
    def lookup(self, own: Own, root: int, depth: int) -> list[tuple[tuple[int, ...], float]]:
        """Prefix paths of the continuations of the nearest keys, each with its share of them:
        [(tokens below the root, share), ...]; [] when nothing is near enough."""
        rows = own.rows
        if rows.rows < 1 or depth < 1:
            return []
        query = rows.keys[-1]  # the state that predicted the root
        if not bool(query.any()):
            return []
        found: list[tuple[float, torch.Tensor, int, int]] = []  # (sim, nexts, row, end)
        if rows.rows > 1:
            found += self._nearest(rows.keys[:-1], rows.nexts[:-1], None, query, root, rows.nexts, rows.rows)
        if self.global_rows.rows:
            found += self._nearest(self.global_rows.keys, self.global_rows.nexts, self.global_valid, query, root,
                                   self.global_rows.nexts, None)
        found.sort(key=lambda f: -f[0])
        found = found[: self.k]
        if not found:
            return []
        self.counts.lookups += 1
        counts: dict[tuple[int, ...], int] = {}
        for _, nexts, row, end in found:
            cont = nexts[row + 1: min(row + 1 + depth, end)].tolist()
            for d in range(1, len(cont) + 1):
                counts[tuple(cont[:d])] = counts.get(tuple(cont[:d]), 0) + 1
        return [(path, c / len(found)) for path, c in counts.items()]

    def _nearest(self, keys, nexts, valid, query, root, all_nexts, end):
        sims = keys @ query  # [n] float16 cosines
        ok = (nexts == root) & (sims >= self.sim)
        if valid is not None:
            ok &= valid
        idx = ok.nonzero().flatten()
        if idx.numel() == 0:
            return []
        if idx.numel() > self.k:
            idx = idx[sims[idx].float().topk(self.k).indices]
        out = []
        for row in idx.tolist():
            stop = end if end is not None else self._segment_end(row)
            out.append((float(sims[row]), all_nexts, row, stop))
        return out

    def _segment_end(self, row: int) -> int:
        return self.global_ends[bisect.bisect_right(self.global_ends, row)]

    def _ends(self) -> None:
        ends, total = [], 0
        for n in self.global_lengths:
            total += n
            ends.append(total)
        self.global_ends = ends

    # -- bookkeeping ------------------------------------------------------------------------------
    def _sync(self, own: Own, tokens: list[int]) -> None:
        """Blank keys for positions the drafter was not given states for (keys lag the tokens)."""
        missing = len(tokens) - 1 - (own.first + own.rows.rows)
        if missing > 0:
            start = own.first + own.rows.rows + 1
            own.rows.append(self._zeros(missing), tokens[start: start + missing])

    def _bound(self, own: Own | None) -> None:
        """Keep every key held within max_bytes: the oldest finished output first, then `own`'s
        oldest positions."""
        while self.memory_bytes() > self.max_bytes and self.global_lengths:
            n = self.global_lengths.popleft()
            self.global_rows.drop_front(n)
            self.global_valid = self.global_valid[n:].clone()
            self._ends()
        over = self.memory_bytes() - self.max_bytes
        if over > 0 and own is not None and own.rows.rows:
            per_row = own.rows.nbytes // own.rows.rows
            drop = min(own.rows.rows, -(-over // per_row))
            own.rows.drop_front(drop)
            own.first += drop

    def memory_bytes(self) -> int:
        """Bytes of keys and next tokens held: the finished outputs' and every running request's."""
        return (self.global_rows.nbytes + self.global_valid.nelement()
                + sum(own.rows.nbytes for own in self._own.values()))

    def _count(self, own: Own, result: VerifyResult) -> None:
        """Was the target's token at the base tree's first miss among the semantic proposals?"""
        self.counts.rounds += 1
        committed = tuple(result.tokens)
        m = 0
        while m < len(committed) and committed[: m + 1] in own.base_paths:
            m += 1
        self.counts.semantic_accepted += max(0, result.num_accepted - m)
        if m < len(committed) and m < own.depth:
            self.counts.base_misses += 1
            self.counts.semantic_present += committed[: m + 1] in own.semantic_paths
        own.base_paths, own.semantic_paths = set(), set()

    def stats(self) -> dict:
        c = self.counts
        return {
            "base": self.base_name, "rounds": c.rounds, "lookups": c.lookups, "base_misses": c.base_misses,
            "semantic_present": c.semantic_present,
            "missed_present_share": c.semantic_present / c.base_misses if c.base_misses else 0.0,
            "semantic_drafted": c.semantic_drafted, "semantic_accepted": c.semantic_accepted,
            "pool_rows": self.global_rows.rows + sum(o.rows.rows for o in self._own.values()),
            "pool_bytes": self.memory_bytes(), "pool_bound_bytes": self.max_bytes,
        }


# -- registration ---------------------------------------------------------------------------------
def build(arg: OilbirdArgument, shape, target, target_path: Path) -> OilbirdDrafter:
    c = target.config
    drafter = OilbirdDrafter(c.num_layers, arg.k, arg.sim, arg.mb, hidden_size=c.hidden_size,
                             norm_weight=target.norm, eps=c.rms_norm_eps, base=arg.base)
    drafter.name = "oilbird" if arg == OilbirdArgument() else f"oilbird:{arg}"
    return drafter


register(DrafterEntry("oilbird", "oilbird[:K[,SIM[,MB]][,base=BASE]]", Capabilities(trees=OilbirdDrafter.trees), build=build,
                      parse_argument=parse_argument))
