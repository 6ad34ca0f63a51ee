"""How every model drafter grows each tree shape for one sequence (spec/shapes.py), one depth a forward.

One grower for the drafters that run a model: draft-model, early-exit, sparsespec and s2moe
(model.py) and the EAGLE-3 head (eagle3.py). A grower (grow.py) yields the nodes it wants fed and
is sent their outputs back, so the drafter can feed every sequence's nodes of a depth in one
forward (grow_together) or each alone (grow_alone, the slow reference). The shapes:
- chain: one draft a depth; greedy takes the argmax, sampling draws from the drafter's warped
  distribution q and keeps q in `draft_probs` (exact rejection sampling needs it);
- static: the top-b children of q at each node (deterministic; a greedy `sampled` shape too);
- sampled (temperature > 0): b children a node drawn from q without replacement (siblings.py), q kept;
- dynamic (EAGLE-2): the K best nodes expanded a depth, the N best of all kept.
Every `Budget` field is honoured: `depth` and `nodes` bound every shape, a node whose path
confidence falls below `min_confidence` is not expanded, and a chain asks `stop(entropies)` after
each draft (`--controller entropy`); a tree shape with that controller is refused when the options
are checked (engine/speculator.py), since trees are not stopped by entropy.

`TreeGrowers` is a mixin, parameterised by how the drafter gets q and feeds nodes. The drafter
class gives `shape`, `target_vocab` and the sequence state (`st.rng`, `st.base` the root's
position, `st.params`, `st.fed` the tree nodes whose K/V rows a forward wrote); how a node's
output reads (the defaults: a model's logits over its vocabulary, `ids` mapping a reduced head's
columns to token ids) and what a fed node carries:
- `_q(logits, params)`: q over the target's vocabulary; `_columns(logits)`: the logits of the
  tokens the drafter can propose; `_tokens(columns)`: their token ids; `_greedy(logits)`: the
  greedy draft;
- `_split(out)` -> (logits [n, columns], carry [n, H] or None): a forward's output for the nodes
  fed; a carry (an EAGLE-3 head: each node's output hidden) goes with each child fed next as
  its `Feed.inputs` (the rows of its parents).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import replace

import torch

from ..sampling import SamplingParams, warp_probs
from ..spec.types import Budget, DraftTree
from .base import ancestors_kept
from .grow import Feed, Grower, done
from .siblings import draw_siblings


class TreeGrowers:
    # -- what a node's output means (a model's logits: the defaults) ----------------------------
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

    def _greedy(self, logits: torch.Tensor) -> int:
        """The greedy draft from one node's logits."""
        return self._tokens(self._columns(logits).float().argmax())

    def _split(self, out) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A forward's output for n fed nodes -> (logits [n, ...], carry [n, H] or None)."""
        return out, None

    # -- drafting, one sequence (a grower: yields the nodes to feed, grow.py) -------------------
    def _grower(self, st, root: int, out_root, depth: int, budget: Budget) -> Grower:
        """out_root: the root's output, as `_split` reads it for one node ([vocab] logits, or
        a tuple with its carry)."""
        if depth < 1 or budget.nodes < 1:
            return done(DraftTree.root_only(root))
        logits, carry = self._split(out_root)
        logits, carry = logits.unsqueeze(0), None if carry is None else carry.unsqueeze(0)  # a frontier of one
        if self.shape.is_chain:
            return self._chain(st, root, logits, carry, min(depth, budget.nodes), budget.min_confidence, budget.stop)
        if self.shape.kind == "static" or (self.shape.kind == "sampled" and st.params.greedy):
            return self._static(st, root, logits, carry, depth, budget.nodes, budget.min_confidence)
        if self.shape.kind == "sampled":
            return self._sampled(st, root, logits, carry, depth, budget.nodes, budget.min_confidence)
        return self._dynamic(st, root, logits, carry, depth, min(budget.nodes, self.shape.max_nodes),
                             budget.min_confidence)

    def _fed(self, out, rows: list[int] | None = None):
        """(logits, carry) of a forward's output, only `rows` of them when given."""
        logits, carry = self._split(out)
        if rows is None:
            return logits, carry
        return logits[rows], None if carry is None else carry[rows]

    def _chain(self, st, root: int, logits: torch.Tensor, carry, k: int, min_confidence: float = 0.0,
               stop=None) -> Grower:
        """Up to k drafts; after the first whose path confidence falls below `min_confidence`, or
        after which `stop(entropies)` says so (Budget.stop: the entropies, nats, of the
        distributions over the drafter's columns the drafts so far came from), no deeper one is
        drafted (that one is kept: dropping a sampled draft for its own probability would bias
        the drafts the verifier sees as draws from q; the entropy of the distribution a draft
        came from does not depend on the draft drawn). logits: [1, columns], carry [1, H] or None."""
        sampling = not st.params.greedy
        drafts, qs, confidence, entropies = [], [], [1.0], []
        logits = logits[0]
        rng = st.rng.at(st.base + 1)  # offset d - 1: the token at depth d (position base + d)
        for d in range(1, k + 1):
            if sampling:
                q = self._q(logits, st.params)
                token = rng.categorical(q, offset=d - 1)
                qs.append(q)
                confidence.append(confidence[-1] * float(q[token]))
            else:
                columns = self._columns(logits).float()
                token = self._greedy(logits)
                confidence.append(confidence[-1] * float(torch.exp(columns.max() - columns.logsumexp(-1))))
            drafts.append(token)
            halt = False
            if stop is not None:  # told every draft's entropy, the last one's too
                logp = torch.log_softmax(self._columns(logits).float(), dim=-1)
                entropies.append(float(-(logp.exp() * logp).sum()))
                halt = stop(entropies)
            if d < k and confidence[-1] >= min_confidence and not halt:
                logits, carry = self._fed((yield Feed([token], list(range(-1, d)), d, carry)))
                st.fed.add(d)
                logits = logits[0]
            else:
                break
        probs = None
        if sampling:
            probs = torch.zeros(len(drafts) + 1, self.target_vocab)
            probs[: len(drafts)] = torch.stack(qs).cpu()
        return replace(DraftTree.chain(root, drafts, probs), confidence=torch.tensor(confidence))

    def _static(self, st, root: int, logits: torch.Tensor, carry, depth: int, max_nodes: int,
                min_confidence: float = 0.0) -> Grower:
        """Top-b children per node; a node whose path confidence is below `min_confidence` gets none.
        logits: [f, columns] of the frontier, carry [f, H] or None."""
        tokens, parents, confidence = [root], [-1], [1.0]
        frontier = [0]
        for d in range(depth):
            width = self.shape.branching[d]
            columns = self._columns(logits).float()  # [f, columns]
            top = columns.topk(min(width, columns.shape[-1]), dim=-1).indices  # [f, width]
            shares = torch.exp(columns.gather(-1, top) - columns.logsumexp(-1, keepdim=True)).tolist()
            new, rows = [], []
            for row, (node, children, share) in enumerate(zip(frontier, self._tokens(top), shares)):
                for token, p in zip(children, share):
                    if len(tokens) - 1 >= max_nodes:
                        break
                    tokens.append(token)
                    parents.append(node)
                    confidence.append(confidence[node] * p)
                    new.append(len(tokens) - 1)
                    rows.append(row)
            if not new or d == depth - 1 or max(confidence[i] for i in new) < min_confidence:
                break
            frontier, logits, carry = yield from self._feed(st, tokens, parents, new, rows, carry, confidence,
                                                            min_confidence)
        return DraftTree(torch.tensor(tokens), torch.tensor(parents), confidence=torch.tensor(confidence))

    def _feed(self, st, tokens: list[int], parents: list[int], new: list[int], rows: list[int], carry,
              confidence: list[float], min_confidence: float) -> Grower:
        """Feed a depth's new nodes (in place: node i at row base + i), each with its parent's
        carry (`rows`: the parent's frontier row); return the next frontier (those of confidence
        >= min_confidence) and their outputs: ([f], [f, columns], [f, H] or None)."""
        first = new[0]
        out = yield Feed(tokens[first:], list(parents), first, None if carry is None else carry[rows])
        st.fed.update(new)
        frontier = [i for i in new if confidence[i] >= min_confidence]
        return (frontier, *self._fed(out, [i - first for i in frontier]))

    def _sampled(self, st, root: int, logits: torch.Tensor, carry, depth: int, max_nodes: int,
                 min_confidence: float = 0.0) -> Grower:
        """b children per node drawn from q without replacement (siblings.py), q kept for the
        verifier; a node whose path confidence is below `min_confidence` gets none (a rule on a
        node's own path, never on which of its siblings were drawn: the siblings kept are always
        the first ones drawn)."""
        tokens, parents, confidence, qs = [root], [-1], [1.0], {}
        frontier = [0]
        rng = st.rng.at(st.base + 1)  # offset d: the tokens at depth d + 1
        for d in range(depth):
            width = self.shape.branching[d]
            new, rows = [], []
            for row, node in enumerate(frontier):
                if len(tokens) - 1 >= max_nodes:
                    break
                q = self._q(logits[row], st.params)  # [target_vocab]
                qs[node] = q
                for token, share in draw_siblings(q, min(width, max_nodes - len(tokens) + 1), rng, d):
                    tokens.append(token)
                    parents.append(node)
                    confidence.append(confidence[node] * share)
                    new.append(len(tokens) - 1)
                    rows.append(row)
            if not new or d == depth - 1 or max(confidence[i] for i in new) < min_confidence:
                break
            frontier, logits, carry = yield from self._feed(st, tokens, parents, new, rows, carry, confidence,
                                                            min_confidence)
        probs = torch.zeros(len(tokens), self.target_vocab)
        for node, q in qs.items():
            probs[node] = q.cpu()
        return DraftTree(torch.tensor(tokens), torch.tensor(parents), probs, torch.tensor(confidence))

    def _dynamic(self, st, root: int, logits: torch.Tensor, carry, depth: int, max_nodes: int,
                 min_confidence: float = 0.0) -> Grower:
        """EAGLE-2 style: expand the K best nodes per depth, then keep the N best of all; nodes
        whose path confidence is below `min_confidence` are not expanded. The expanded nodes are
        fed as a tree of their own (`written`: candidate -> its node there, node 0 the root's row)."""
        k = self.shape.top_k
        floor = math.log(min_confidence) if min_confidence > 0 else -math.inf
        # candidates: (score, node id in `cand`); cand[i] = (token, parent cand id, score)
        cand: list[tuple[int, int, float]] = [(root, -1, 0.0)]
        written = {0: 0}  # cand id -> tree node index in the drafter cache this round
        tokens, parents = [root], [-1]
        frontier = [0]
        for d in range(depth):
            logp = torch.log_softmax(self._columns(logits).float(), dim=-1)
            top = logp.topk(min(k, logp.shape[-1]), dim=-1)
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
            row = {cid: i for i, cid in enumerate(frontier)}
            inputs = None if carry is None else carry[[row[cand[cid][1]] for cid in best]]  # each parent's carry
            logits, carry = self._fed((yield Feed(tokens[first:], list(parents), first, inputs)))
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


def _tree_from_candidates(cand, chosen: list[int], written: dict[int, int], st) -> DraftTree:
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
