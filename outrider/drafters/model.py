"""Model-based drafters: an independent draft model, or the target's own first layers.

Both run a `Decoder` (the draft model's, or the target's with `num_layers=K` for self-speculative
early exit) with a KV cache of their own, one slot per sequence in one multi-slot cache
(slots.py), kept in step with the committed prefix: after each round the rows of the accepted
path stay, the rest are rolled back.

Early exit in an engine shares the target's cache instead (`share_target_cache`): the target's
first K layers over the committed prefix ARE what the drafter would compute, and the target's
prefill and verify forwards already wrote them. So the prompt is not prefilled again, nothing is
caught up but the root, nothing is rolled back, and no second cache is held: each round the
drafter writes the root and its drafts in rows past the committed prefix of the sequence's own
target slot (layers < K only), and the verify forward overwrites those rows. Without an attached
target cache (a drafter driven by hand) it keeps its own, as the draft model does.

Batched (one call per round, `propose_batch`): one forward writes every sequence's newly
committed tokens (the catch-up: the root, and the accepted drafts and bonus the drafter did not
feed) and gives each its first draft distribution; then each further draft depth is ONE forward
for all sequences still growing (grow.py). A sequence's prompt is written at `start`.

Drafting by shape (spec/shapes.py):
- chain: one forward per depth; greedy takes the argmax, sampling draws from the drafter's
  warped distribution q and keeps q in `draft_probs` (exact rejection sampling needs it);
- static / dynamic trees: the top children of q at each node (deterministic), grown one depth
  per forward with the tree's ancestor mask; verified by the greedy or tree-walk verifier;
- sampled trees (`sampled:B1,B2,...`, temperature > 0 only): the static tree's widths, each
  node's children drawn from q without replacement (siblings.py), q kept in `draft_probs`;
  verified by multi-draft rejection sampling.

With a `window` (window.py, `draft-model:NAME,window=W,sink=S`) the draft model attends to its
sink and its last W positions only, and its own cache keeps only those rows: a sequence's
positions (st.cached, st.base: token counts) are its cache rows plus `st.shift` past the sink.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field, replace

import torch

from ..models.batch import pack
from ..models.decoder import Decoder
from ..sampling import SamplingParams, warp_probs
from ..spec.random import PositionalRandom
from ..spec.shapes import TreeShape
from ..spec.tree import children as children_of
from ..spec.types import DraftTree, VerifyResult
from .base import Budget, ancestors_kept
from .capabilities import Capabilities, Drafts
from .grow import Feed, Grower, done, grow_alone, grow_together
from .siblings import draw_siblings
from .slots import SlotCache
from .window import Window, reclaim


@dataclass
class _State:
    slot: int  # this sequence's slot in the drafter's cache
    params: SamplingParams
    rng: PositionalRandom  # the request's drafting streams (sampled chains draw from q)
    cached: int = 0  # rows of committed tokens in the cache
    base: int = 0  # len(tokens) - 1 at the last proposal: row of the root
    fed: set[int] = field(default_factory=set)  # tree nodes whose K/V this round wrote
    proposed: bool = False  # a proposal since the last update (a round may skip the drafter)
    tree: tuple[list[int], list[int]] = ((), ())  # the proposed tree's tokens and parents
    shift: int = 0  # positions minus cache rows past the sink (a window reclaimed the rows between)


class ModelDrafter:
    """Drafts with a `Decoder` of its own (or the target's first layers); registered as the
    `draft-model` (draft_model.py) and `early-exit` (early_exit.py) drafters.

    batched=False drafts each sequence with forwards of its own (the slow reference, grow.py)."""

    capabilities = Capabilities(trees={
        "chain": Drafts("chain", gives_probs=True),  # sampled: each draft drawn from q, q kept
        "static": Drafts("tree"),  # top-b children of q: not draws
        "sampled": Drafts("tree", gives_probs=True, without_replacement=True),  # b draws from q per node
        "dynamic": Drafts("tree"),  # best nodes by cumulative log q: not draws
    })

    def __init__(self, decoder: Decoder, shape: TreeShape, *, num_layers: int | None = None,
                 name: str = "draft-model", target_vocab: int | None = None, batched: bool = True,
                 share_target_cache: bool = False, window: Window | None = None):
        """share_target_cache: `decoder` is the target and drafts over the target's cache once
        the engine attaches it (early exit; see the module's notes). window: attend to a sink and
        the last W positions only, in a bounded cache of its own (window.py)."""
        if window is not None and share_target_cache:
            raise ValueError(f"{name}: a window needs a cache of the drafter's own, not the target's")
        self.window = window
        self.decoder = decoder
        self.shape = shape
        self.num_layers = num_layers
        self.name = name
        self.target_vocab = target_vocab or decoder.config.vocab_size
        # a reduced head (Decoder.head_ids): logits column i is token ids[i]; it proposes no other
        ids = decoder.head_ids
        if ids is not None and int(ids.max()) >= self.target_vocab:
            raise ValueError(f"{name}: its draft vocabulary holds ids past the target's {self.target_vocab} tokens")
        self.ids = None if ids is None else ids.cpu()
        self.batched = batched
        if share_target_cache:
            self.capabilities = replace(type(self).capabilities, reads_target_cache=True)
        self.target_cache = None  # the target's KVCache, when drafting over it (attach_target_cache)
        self._slots: SlotCache | None = None  # its own cache, made at the first sequence that needs it
        self._states: dict[int, _State] = {}

    @property
    def slots(self) -> SlotCache:
        if self._slots is None:
            layers = self.num_layers or self.decoder.config.num_layers
            self._slots = SlotCache(lambda n, rows: self.decoder.new_cache(n, rows, num_layers=layers))
        return self._slots

    @property
    def cache(self):
        return self.target_cache if self.target_cache is not None else self.slots.cache

    def attach_target_cache(self, cache) -> None:
        """Draft over the target's own cache from now on. A new engine attaches its cache before
        its first sequence starts; sequences left by an earlier engine (an interrupted run) are
        dropped, their rows belonging to a cache that is gone."""
        for seq_id in list(self._states):
            self.finish(seq_id, [])
        self.target_cache = cache

    # -- protocol -----------------------------------------------------------------------------
    def max_nodes(self, depth: int) -> int:
        return self.shape.max_drafts(depth)

    def start(self, seq_id: int, prompt: list[int], params: SamplingParams | None = None,
              target_slot: int | None = None) -> None:
        """Take a slot and write the prompt's K/V but the last token's (the first round's root);
        over the target's cache, use the sequence's `target_slot`, whose prompt rows the
        target's prefill wrote."""
        params = params or SamplingParams()
        self.finish(seq_id, prompt)  # a state left by an interrupted run gives its slot back
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**63 - 1, ()))
        rng = PositionalRandom(seed).drafting()  # apart from the verifier's
        if self.target_cache is not None:
            if target_slot is None:
                raise ValueError(f"{self.name} drafts over the target's cache: start() needs the sequence's target_slot")
            self._states[seq_id] = _State(target_slot, params, rng, cached=len(prompt) - 1)
            return
        st = _State(self.slots.take(), params, rng)
        self._states[seq_id] = st
        if len(prompt) > 1 and self.window is not None:  # in chunks, the dead rows reclaimed between
            for at in range(0, len(prompt) - 1, self.window.chunk):
                part = prompt[at : min(at + self.window.chunk, len(prompt) - 1)]
                self.slots.ensure_rows(st.cached - st.shift + len(part) + 1)
                batch = pack([st.slot], [st.cached - st.shift], [torch.tensor(part)], logits="none",
                             scratch_row=self.cache.scratch_row, device=self.decoder.device,
                             shifts=[st.shift], window=self.window.mask_args())
                self.decoder.forward(batch, self.cache, num_layers=self.num_layers)
                st.cached += len(part)
                self.cache.set_length(st.slot, st.cached - st.shift)
                self._reclaim(st)
        elif len(prompt) > 1:
            self.slots.ensure_rows(len(prompt))
            batch = pack([st.slot], [0], [torch.tensor(prompt[:-1])], logits="none",
                         scratch_row=self.cache.scratch_row, device=self.decoder.device)
            self.decoder.forward(batch, self.cache, num_layers=self.num_layers)
            st.cached = len(prompt) - 1
            self.cache.set_length(st.slot, st.cached)

    def propose(self, seq_id: int, tokens: list[int], budget: Budget) -> DraftTree:
        return self.propose_batch([seq_id], [tokens], [budget])[0]

    def propose_batch(self, seq_ids: list[int], tokens: list[list[int]], budgets: list[Budget]) -> list[DraftTree]:
        """A tree per sequence: one catch-up forward, then one forward per draft depth for all."""
        states = [self._states[s] for s in seq_ids]
        depths = [self.shape.max_depth(b.depth) for b in budgets]
        if self.target_cache is None:
            for st in states:
                self._reclaim(st)
            self.slots.ensure_rows(max(len(t) - st.shift + self.shape.fed_nodes(d)
                                       for st, t, d in zip(states, tokens, depths)))
        else:  # the target's slots do not grow: draft no deeper than the rows past the prefix allow
            limit = self.target_cache.max_len
            depths = [self._fits(d, len(t), limit) for t, d in zip(tokens, depths)]
            for st, toks in zip(states, tokens):
                st.cached = len(toks) - 1  # the target's cache holds the committed prefix
        for st, toks in zip(states, tokens):
            st.base, st.fed, st.proposed = len(toks) - 1, {0}, True  # rows 0..base, then fed nodes
        q_roots = self._catch_up(states, tokens)  # [B, vocab] logits after each root
        growers = [self._grower(st, toks[-1], q_root, depth, budget)
                   for st, toks, q_root, depth, budget in zip(states, tokens, q_roots, depths, budgets)]

        def forward(indices: list[int], feeds: list[Feed]) -> list[torch.Tensor]:
            return self._forward([states[i] for i in indices], feeds)

        trees = (grow_together if self.batched else grow_alone)(growers, forward)
        for st, tree in zip(states, trees):
            st.tree = (tree.tokens.tolist(), tree.parents.tolist())
        return trees

    def _fits(self, depth: int, length: int, max_len: int) -> int:
        """The deepest depth <= `depth` whose root and fed nodes fit in rows length - 1 .. max_len - 1."""
        while depth > 0 and length + self.shape.fed_nodes(depth) > max_len:
            depth -= 1
        return depth

    def update(self, seq_id: int, result: VerifyResult, hidden: torch.Tensor | None = None) -> None:
        st = self._states[seq_id]
        if not st.proposed:  # the round drafted nothing for it: the catch-up will feed the commit
            return
        st.proposed = False
        if self.target_cache is not None:
            return  # the target's verify forward wrote the accepted path's rows and set the length
        # the committed tokens walked down this drafter's own tree: the round may have verified
        # another tree (a grammar prunes drafts or drafts forced tokens: engine/loop.py), and a
        # node whose token and path are the committed ones holds their K/V whatever was verified
        tokens, parents = st.tree
        kids = children_of(list(parents))
        path = [0]
        for token in result.tokens[:-1]:
            node = next((c for c in kids[path[-1]] if tokens[c] == token and c in st.fed), None)
            if node is None:
                break
            path.append(node)
        base = st.base - st.shift  # the root's cache row
        self.cache.compact(st.slot, [base + node for node in path], base)
        st.cached = st.base + len(path)
        self.cache.set_length(st.slot, st.cached - st.shift)

    def update_batch(self, seq_ids: list[int], results: list[VerifyResult], hidden: list) -> None:
        for seq_id, result in zip(seq_ids, results):  # host bookkeeping and row moves: no forward
            self.update(seq_id, result)

    def finish(self, seq_id: int, tokens: list[int]) -> None:
        st = self._states.pop(seq_id, None)
        if st is not None and self.target_cache is None:
            self.slots.give(st.slot)

    # -- the forwards -------------------------------------------------------------------------
    def _reclaim(self, st: _State) -> None:
        """A window's dead rows of this sequence, dropped once there are enough (window.py)."""
        if self.window is not None:
            rows, st.shift = reclaim(self.window, self.cache, st.slot, st.cached - st.shift, st.shift)

    def _windowed(self, states: list[_State]) -> dict:
        """pack's window arguments for these sequences (none without a window)."""
        if self.window is None:
            return {}
        return {"shifts": [st.shift for st in states], "window": self.window.mask_args()}

    @property
    def cache_rows(self) -> int:
        """Rows a slot of the drafter's own cache holds (grown by doubling; 0 over the target's)."""
        return 0 if self.target_cache is not None or self._slots is None else self._slots.cache.max_len

    def _forward(self, states: list[_State], feeds: list[Feed]) -> list[torch.Tensor]:
        """One forward writing each sequence's fed tree nodes; returns their logits [n_b, vocab]."""
        batch = pack([st.slot for st in states], [st.base - st.shift for st in states],
                     [torch.tensor(f.tokens) for f in feeds], [torch.tensor(f.parents) for f in feeds],
                     logits="real", scratch_row=self.cache.scratch_row, device=self.decoder.device,
                     first_nodes=[f.first for f in feeds], **self._windowed(states))
        logits = self.decoder.forward(batch, self.cache, num_layers=self.num_layers).logits  # [sum n_b, vocab]
        return list(logits.split([len(f.tokens) for f in feeds]))

    def _catch_up(self, states: list[_State], tokens: list[list[int]]) -> torch.Tensor:
        """Feed every sequence's committed tokens its cache lacks (the root at least), in one
        forward; returns the logits after each root [B, vocab]."""
        pending = [torch.tensor(toks[st.cached:]) for st, toks in zip(states, tokens)]
        batch = pack([st.slot for st in states], [st.cached - st.shift for st in states], pending, logits="last",
                     scratch_row=self.cache.scratch_row, device=self.decoder.device, **self._windowed(states))
        logits = self.decoder.forward(batch, self.cache, num_layers=self.num_layers).logits[:, 0]  # [B, vocab]
        for st in states:
            st.cached = st.base  # the root's row belongs to this round's tree (node 0)
            if self.target_cache is None:  # the target's lengths are the engine's
                self.cache.set_length(st.slot, st.cached - st.shift)
        return logits

    # -- drafting, one sequence (a grower: yields the nodes to feed, grow.py) -------------------
    def _grower(self, st: _State, root: int, q_root: torch.Tensor, depth: int, budget: Budget) -> Grower:
        if depth < 1 or budget.nodes < 1:
            return done(DraftTree.root_only(root))
        if self.shape.is_chain:
            return self._chain(st, root, q_root, min(depth, budget.nodes), budget.min_confidence, budget.stop)
        if self.shape.kind == "static" or (self.shape.kind == "sampled" and st.params.greedy):
            return self._static(st, root, q_root, depth, budget.nodes, budget.min_confidence)
        if self.shape.kind == "sampled":
            return self._sampled(st, root, q_root, depth, budget.nodes, budget.min_confidence)
        return self._dynamic(st, root, q_root, depth, min(budget.nodes, self.shape.max_nodes), budget.min_confidence)

    def _q(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """The drafter's distribution over the target's vocabulary: [..., target_vocab] (zero
        outside a reduced head's tokens)."""
        probs = warp_probs(logits, params)
        if self.ids is not None:
            full = probs.new_zeros(*probs.shape[:-1], self.target_vocab)
            return full.index_copy_(-1, self.ids.to(probs.device), probs)
        extra = self.target_vocab - probs.shape[-1]
        if extra > 0:
            probs = torch.nn.functional.pad(probs, (0, extra))
        return probs[..., : self.target_vocab]

    def _columns(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits of tokens the target has: [..., columns] (all of a reduced head's)."""
        return logits if self.ids is not None else logits[..., : self.target_vocab]

    def _tokens(self, columns: torch.Tensor) -> list:
        """Column indices of `_columns` -> token ids (nested lists as `tolist` gives)."""
        return (columns if self.ids is None else self.ids[columns.cpu()]).tolist()

    def _chain(self, st: _State, root: int, q_root: torch.Tensor, k: int, min_confidence: float = 0.0,
               stop=None) -> Grower:
        """Up to k drafts; after the first whose path confidence falls below `min_confidence`, or
        after which `stop(entropies)` says so (Budget.stop), no deeper one is drafted (that one
        is kept: dropping a sampled draft for its own probability would bias the drafts the
        verifier sees as draws from q; the entropy of the distribution a draft came from does
        not depend on the draft drawn)."""
        sampling = not st.params.greedy
        drafts, qs, confidence, entropies = [], [], [1.0], []
        logits = q_root
        rng = st.rng.at(st.base + 1)  # offset d - 1: the token at depth d (position base + d)
        for d in range(1, k + 1):
            q = self._q(logits, st.params)
            if sampling:
                token = rng.categorical(q, offset=d - 1)
                confidence.append(confidence[-1] * float(q[token]))
            else:
                columns = self._columns(logits).float()
                best = columns.argmax()
                token = self._tokens(best)
                confidence.append(confidence[-1] * float(torch.exp(columns[best] - columns.logsumexp(-1))))
            drafts.append(token)
            qs.append(q)
            halt = False
            if stop is not None:  # told every draft's entropy, the last one's too
                logp = torch.log_softmax(self._columns(logits).float(), dim=-1)
                entropies.append(float(-(logp.exp() * logp).sum()))
                halt = stop(entropies)
            if d < k and confidence[-1] >= min_confidence and not halt:
                logits = (yield Feed([token], list(range(-1, d)), d))[0]
                st.fed.add(d)
            else:
                break
        probs = None
        if sampling:
            probs = torch.zeros(len(drafts) + 1, self.target_vocab)
            probs[: len(drafts)] = torch.stack(qs).cpu()
        return replace(DraftTree.chain(root, drafts, probs), confidence=torch.tensor(confidence))

    def _static(self, st: _State, root: int, q_root: torch.Tensor, depth: int, max_nodes: int,
                min_confidence: float = 0.0) -> Grower:
        """Top-b children per node; a node whose path confidence is below `min_confidence` gets none."""
        tokens, parents, confidence = [root], [-1], [1.0]
        frontier, frontier_logits = [0], q_root.unsqueeze(0)  # [f, vocab]
        for d in range(depth):
            width = self.shape.branching[d]
            columns = self._columns(frontier_logits).float()  # [f, columns]
            top = columns.topk(width, dim=-1).indices  # [f, width]
            shares = torch.exp(columns.gather(-1, top) - columns.logsumexp(-1, keepdim=True)).tolist()
            new = []
            for node, children, share in zip(frontier, self._tokens(top), shares):
                for token, p in zip(children, share):
                    if len(tokens) - 1 >= max_nodes:
                        break
                    tokens.append(token)
                    parents.append(node)
                    confidence.append(confidence[node] * p)
                    new.append(len(tokens) - 1)
            if not new or d == depth - 1 or max(confidence[i] for i in new) < min_confidence:
                break
            frontier, frontier_logits = yield from self._feed(st, tokens, parents, new, confidence, min_confidence)
        return DraftTree(torch.tensor(tokens), torch.tensor(parents), confidence=torch.tensor(confidence))

    def _feed(self, st: _State, tokens: list[int], parents: list[int], new: list[int], confidence: list[float],
              min_confidence: float) -> Grower:
        """Feed a depth's new nodes; return the next frontier (those of confidence >= min_confidence)
        and their rows of the logits: ([f], [f, vocab])."""
        first = new[0]
        logits = yield Feed(tokens[first:], list(parents), first)
        st.fed.update(new)
        frontier = [i for i in new if confidence[i] >= min_confidence]
        return frontier, logits[[i - first for i in frontier]]

    def _sampled(self, st: _State, root: int, q_root: torch.Tensor, depth: int, max_nodes: int,
                 min_confidence: float = 0.0) -> Grower:
        """b children per node drawn from q without replacement (siblings.py), q kept for the
        verifier; a node whose path confidence is below `min_confidence` gets none (a rule on a
        node's own path, never on which of its siblings were drawn: the siblings kept are always
        the first ones drawn)."""
        tokens, parents, confidence, qs = [root], [-1], [1.0], {}
        frontier, frontier_logits = [0], q_root.unsqueeze(0)  # [f, vocab]
        rng = st.rng.at(st.base + 1)  # offset d: the tokens at depth d + 1
        for d in range(depth):
            width = self.shape.branching[d]
            new = []
            for node, logits in zip(frontier, frontier_logits):
                if len(tokens) - 1 >= max_nodes:
                    break
                q = self._q(logits, st.params)  # [target_vocab]
                qs[node] = q
                for token, share in draw_siblings(q, min(width, max_nodes - len(tokens) + 1), rng, d):
                    tokens.append(token)
                    parents.append(node)
                    confidence.append(confidence[node] * share)
                    new.append(len(tokens) - 1)
            if not new or d == depth - 1 or max(confidence[i] for i in new) < min_confidence:
                break
            frontier, frontier_logits = yield from self._feed(st, tokens, parents, new, confidence, min_confidence)
        probs = torch.zeros(len(tokens), self.target_vocab)
        for node, q in qs.items():
            probs[node] = q.cpu()
        return DraftTree(torch.tensor(tokens), torch.tensor(parents), probs, torch.tensor(confidence))

    def _dynamic(self, st: _State, root: int, q_root: torch.Tensor, depth: int, max_nodes: int,
                 min_confidence: float = 0.0) -> Grower:
        """EAGLE-2 style: expand the K best nodes per depth, then keep the N best of all; nodes
        whose path confidence is below `min_confidence` are not expanded."""
        k = self.shape.top_k
        floor = math.log(min_confidence) if min_confidence > 0 else -math.inf
        # candidates: (score, node id in `cand`); cand[i] = (token, parent cand id, score)
        cand: list[tuple[int, int, float]] = [(root, -1, 0.0)]
        written = {0: 0}  # cand id -> tree node index in the drafter cache this round
        tokens, parents = [root], [-1]
        frontier, frontier_logits = [0], q_root.unsqueeze(0)
        for d in range(depth):
            logp = torch.log_softmax(self._columns(frontier_logits).float(), dim=-1)
            top = logp.topk(k, dim=-1)
            scored = []
            for row, cid in enumerate(frontier):
                for lp, token in zip(top.values[row].tolist(), self._tokens(top.indices[row])):
                    cand.append((token, cid, cand[cid][2] + lp))
                    scored.append(len(cand) - 1)
            best = [c for c in heapq.nlargest(k, scored, key=lambda c: cand[c][2]) if cand[c][2] >= floor]
            if d == depth - 1 or not best:
                break
            first = len(tokens)
            for cid in best:  # write the expanded nodes in the cache as tree nodes
                tokens.append(cand[cid][0])
                parents.append(written[cand[cid][1]])
                written[cid] = len(tokens) - 1
            frontier_logits = yield Feed(tokens[first:], list(parents), first)
            st.fed.update(range(first, len(tokens)))
            frontier = best
        keep = heapq.nlargest(max_nodes, range(1, len(cand)), key=lambda c: cand[c][2])
        keep_set = set(keep)
        keep = [c for c in keep if ancestors_kept(cand, c, keep_set)]
        return _tree_from_candidates(cand, sorted(keep, key=lambda c: _depth(cand, c)), written, st)


def _depth(cand, c: int) -> int:
    d = 0
    while cand[c][1] >= 0:
        c, d = cand[c][1], d + 1
    return d


def _tree_from_candidates(cand, chosen: list[int], written: dict[int, int], st: _State) -> DraftTree:
    """Lay the chosen candidates out as a tree (parents first). The cache rows written while
    expanding used other node numbers; only the root's rows are reused, so mark the rest unfed."""
    index = {0: 0}
    tokens, parents = [cand[0][0]], [-1]
    for c in chosen:
        index[c] = len(tokens)
        tokens.append(cand[c][0])
        parents.append(index[cand[c][1]])
    # node numbers changed: keep as 'fed' only nodes whose cache row number is unchanged
    st.fed = {0} | {index[c] for c in chosen if written.get(c) == index[c]}
    confidence = torch.tensor([0.0] + [cand[c][2] for c in chosen]).exp()  # cumulative log q -> path probability
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), confidence=confidence)
