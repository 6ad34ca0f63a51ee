"""Model-based drafters: an independent draft model, or the target's own first layers.

Both run a `Decoder` (the draft model's, or the target's with `num_layers=K` for self-speculative
early exit) with a KV cache of their own, one slot per sequence, kept in step with the committed
prefix: after each round the rows of the accepted path stay, the rest are rolled back.

Drafting by shape (spec/shapes.py):
- chain: one forward per depth; greedy takes the argmax, sampling draws from the drafter's
  warped distribution q and keeps q in `draft_probs` (exact rejection sampling needs it);
- static / dynamic trees: the top children of q at each node (deterministic), grown one depth
  per forward with the tree's ancestor mask; verified by the greedy or tree-walk verifier.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import torch

from ..kv import KVCache
from ..models.batch import pack
from ..models.decoder import Decoder
from ..sampling import SamplingParams, warp_probs
from ..spec.random import PositionalRandom
from ..spec.shapes import TreeShape
from ..spec.types import DraftTree, VerifyResult
from .base import Budget, ancestors_kept
from .capabilities import Capabilities, Drafts


@dataclass
class _State:
    cache: KVCache
    params: SamplingParams
    rng: PositionalRandom  # the request's drafting streams (sampled chains draw from q)
    cached: int = 0  # rows of committed tokens in the cache
    base: int = 0  # len(tokens) - 1 at the last proposal: row of the root
    fed: set[int] = field(default_factory=set)  # tree nodes whose K/V this round wrote


class ModelDrafter:
    """Drafts with a `Decoder` of its own (or the target's first layers); registered as the
    `draft-model` (draft_model.py) and `early-exit` (early_exit.py) drafters."""

    capabilities = Capabilities(trees={
        "chain": Drafts("chain", gives_probs=True),  # sampled: each draft drawn from q, q kept
        "static": Drafts("tree"),  # top-b children of q: not draws
        "dynamic": Drafts("tree"),  # best nodes by cumulative log q: not draws
    })

    def __init__(self, decoder: Decoder, shape: TreeShape, *, num_layers: int | None = None,
                 name: str = "draft-model", target_vocab: int | None = None):
        self.decoder = decoder
        self.shape = shape
        self.num_layers = num_layers
        self.name = name
        self.target_vocab = target_vocab or decoder.config.vocab_size
        self._states: dict[int, _State] = {}

    # -- protocol -----------------------------------------------------------------------------
    def max_nodes(self, depth: int) -> int:
        return self.shape.max_drafts(depth)

    def start(self, seq_id: int, prompt: list[int], params: SamplingParams | None = None) -> None:
        params = params or SamplingParams()
        layers = self.num_layers or self.decoder.config.num_layers
        cache = self.decoder.new_cache(1, max(256, 2 * len(prompt)), num_layers=layers)
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**63 - 1, ()))
        self._states[seq_id] = _State(cache, params, PositionalRandom(seed).drafting())  # apart from the verifier's

    def propose(self, seq_id: int, tokens: list[int], budget: Budget) -> DraftTree:
        st = self._states[seq_id]
        depth = self.shape.max_depth(budget.depth)
        st.base = len(tokens) - 1
        st.fed = {0}
        st.cache.ensure_capacity(len(tokens) + self.shape.fed_nodes(depth))  # rows 0..base, then fed nodes
        q_root = self._catch_up(st, tokens)  # [vocab] logits after the root
        if depth < 1 or budget.nodes < 1:
            return DraftTree.root_only(tokens[-1])
        if self.shape.is_chain:
            return self._chain(st, tokens[-1], q_root, min(depth, budget.nodes))
        if self.shape.kind == "static":
            return self._static(st, tokens[-1], q_root, depth, budget.nodes)
        return self._dynamic(st, tokens[-1], q_root, depth, min(budget.nodes, self.shape.max_nodes))

    def update(self, seq_id: int, result: VerifyResult, hidden: torch.Tensor | None = None) -> None:
        st = self._states[seq_id]
        path = [0]
        for node in result.accepted_nodes:
            if node not in st.fed:
                break
            path.append(node)
        st.cache.compact(0, [st.base + node for node in path], st.base)
        st.cached = st.base + len(path)
        st.cache.set_length(0, st.cached)

    def finish(self, seq_id: int, tokens: list[int]) -> None:
        self._states.pop(seq_id, None)

    # -- drafting -----------------------------------------------------------------------------
    def _forward(self, st: _State, tokens: list[int], parents: list[int] | None, first: int,
                 start: int) -> torch.Tensor:
        """Write the K/V of `tokens` and return their logits [n, vocab] (float32)."""
        batch = pack([0], [start], [torch.tensor(tokens)],
                     None if parents is None else [torch.tensor(parents)],
                     scratch_row=st.cache.scratch_row, device=self.decoder.device,
                     first_nodes=None if parents is None else [first])
        return self.decoder.forward(batch, st.cache, num_layers=self.num_layers).logits[0]

    def _catch_up(self, st: _State, tokens: list[int]) -> torch.Tensor:
        """Feed the committed tokens the cache lacks (the root at least); logits after the root."""
        pending = tokens[st.cached:]
        logits = self._forward(st, pending, None, 0, st.cached)
        st.cached = len(tokens) - 1  # the root's row belongs to this round's tree (node 0)
        st.cache.set_length(0, st.cached)
        return logits[-1]

    def _q(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """The drafter's distribution over the target's vocabulary: [..., target_vocab]."""
        probs = warp_probs(logits, params)
        extra = self.target_vocab - probs.shape[-1]
        if extra > 0:
            probs = torch.nn.functional.pad(probs, (0, extra))
        return probs[..., : self.target_vocab]

    def _chain(self, st: _State, root: int, q_root: torch.Tensor, k: int) -> DraftTree:
        sampling = not st.params.greedy
        drafts, qs = [], []
        logits = q_root
        rng = st.rng.at(st.base + 1)  # offset d - 1: the token at depth d (position base + d)
        for d in range(1, k + 1):
            q = self._q(logits, st.params)
            token = rng.categorical(q, offset=d - 1) if sampling else int(logits[: self.target_vocab].argmax())
            drafts.append(token)
            qs.append(q)
            if d < k:
                logits = self._forward(st, [token], list(range(-1, d)), d, st.base)[0]
                st.fed.add(d)
        probs = None
        if sampling:
            probs = torch.zeros(k + 1, self.target_vocab)
            probs[:k] = torch.stack(qs).cpu()
        return DraftTree.chain(root, drafts, probs)

    def _static(self, st: _State, root: int, q_root: torch.Tensor, depth: int, max_nodes: int) -> DraftTree:
        tokens, parents = [root], [-1]
        frontier, frontier_logits = [0], q_root.unsqueeze(0)  # [f, vocab]
        for d in range(depth):
            width = self.shape.branching[d]
            top = frontier_logits[:, : self.target_vocab].topk(width, dim=-1).indices.tolist()
            new = []
            for node, children in zip(frontier, top):
                for token in children:
                    if len(tokens) - 1 >= max_nodes:
                        break
                    tokens.append(token)
                    parents.append(node)
                    new.append(len(tokens) - 1)
            if not new or d == depth - 1:
                break
            first = new[0]
            frontier_logits = self._forward(st, tokens[first:], parents, first, st.base)
            st.fed.update(new)
            frontier = new
        return DraftTree(torch.tensor(tokens), torch.tensor(parents))

    def _dynamic(self, st: _State, root: int, q_root: torch.Tensor, depth: int, max_nodes: int) -> DraftTree:
        """EAGLE-2 style: expand the K best nodes per depth, then keep the N best of all."""
        k = self.shape.top_k
        # candidates: (score, node id in `cand`); cand[i] = (token, parent cand id, score)
        cand: list[tuple[int, int, float]] = [(root, -1, 0.0)]
        written = {0: 0}  # cand id -> tree node index in the drafter cache this round
        tokens, parents = [root], [-1]
        frontier, frontier_logits = [0], q_root.unsqueeze(0)
        for d in range(depth):
            logp = torch.log_softmax(frontier_logits[:, : self.target_vocab].float(), dim=-1)
            top = logp.topk(k, dim=-1)
            scored = []
            for row, cid in enumerate(frontier):
                for lp, token in zip(top.values[row].tolist(), top.indices[row].tolist()):
                    cand.append((token, cid, cand[cid][2] + lp))
                    scored.append(len(cand) - 1)
            best = heapq.nlargest(k, scored, key=lambda c: cand[c][2])
            if d == depth - 1:
                break
            first = len(tokens)
            for cid in best:  # write the expanded nodes in the cache as tree nodes
                tokens.append(cand[cid][0])
                parents.append(written[cand[cid][1]])
                written[cid] = len(tokens) - 1
            frontier_logits = self._forward(st, tokens[first:], parents, first, st.base)
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
    return DraftTree(torch.tensor(tokens), torch.tensor(parents))
