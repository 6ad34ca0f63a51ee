"""`--drafter eagle3:PATH_OR_NAME`: an EAGLE-3 head (heads/eagle3/head.py) drafts from the target's own features.

PATH is a head folder (config.json + model.safetensors, heads/eagle3/format.py), in the EAGLE or
the speculators layout; NAME a head shipped for that target (heads/catalog.py). The head reads
three target layers; the drafter declares them as `needs_hidden` (in our tap convention, converted
from the head's), so the target's verify forward of each round returns them at no extra pass and
the speculator hands over each sequence's rows of the accepted path; the prompt's come from the
prefill forward.

The head's K/V follows the committed prefix. Head row p holds (feature of position p, token p+1):
with n committed tokens, rows 0..n-2 are the committed ones, built only from target features.
Between rounds the features of the newly committed positions wait in `pending` (pending.py) and
are written at the next proposal (one forward, causal), whose last row gives the first draft's
distribution. The prompt's wait too: a request the controller never lets draft (`cost` at depth
0) never runs the head over its prompt (about 8% of the target's prefill, on SmolLM2):

    start(prompt x_0..x_{n-1}, features f_0..f_{n-2})      pending = those n-1 rows
    propose: write rows 0..n-2 (tokens x_1..x_{n-1})       rows = n-1; row n-2 predicts x_n
             drafts: node i of the tree (depth d) is head row n-2+i at position n-2+d, fed the
             output hidden of its parent's row and its own token; written past the committed rows
    update(accepted path a nodes, features f_{n-1}..f_{n-1+a})  pending = those a+1 rows

Draft rows are never kept: the committed length is the rollback. All sequences share one
multi-slot head cache (slots.py); a round is one catch-up forward for the batch, then one
forward per draft depth for the sequences still growing (grow.py). The head takes slots in
order without holes, so each forward covers the span of the slots that feed, the others as
empty rows. Drafting by `--tree`:
chain (greedy: argmax; sampling: each draft drawn from q, the head's warped distribution over the
target vocabulary, kept for rejection sampling), static:B1,.. (top-b children) and dynamic:K,N
(EAGLE-2: expand the K best nodes by cumulative log-probability per depth, keep the N best),
the trees verified by the greedy or tree-walk verifier; sampled:B1,.. (temperature > 0 only: the
static widths, each node's children drawn from q without replacement, siblings.py; q kept for
multi-draft rejection sampling).

`eagle3:PATH_OR_NAME[@DTYPE],window=W[,sink=S]` (Windowed-MTP, window.py): the head attends to
its first S rows and its last W only (a query at position p: positions < S and p - W + 1 .. p),
and its cache keeps only those rows; a long prompt's rows are written in chunks. A sequence's
positions (`rows`) are its cache rows plus `shift` past the sink.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..heads.eagle3.head import Eagle3Head
from ..heads.eagle3.format import load_eagle3
from ..models.batch import pack
from ..sampling import SamplingParams, warp_probs
from ..spec.random import PositionalRandom
from ..spec.shapes import TreeShape
from ..spec.types import Budget, DraftTree, VerifyResult
from .base import DrafterBase, ancestors_kept
from .capabilities import Capabilities, Drafts
from .draft_model import draft_vocab_ids
from .eagle3_options import USAGE, argument_options, check_fits, head_dtype, parse_argument, split_dtype  # noqa: F401 (tests)
from .grow import Feed, Grower, done, grow_alone, grow_together
from .pending import PendingRows
from .registry import DrafterEntry, register
from .siblings import draw_siblings
from .slots import SlotCache
from .window import Window, reclaim

TREES = {
    "chain": Drafts("chain", gives_probs=True),  # sampled: each draft drawn from q, q kept
    "static": Drafts("tree"),  # top-b children: not draws
    "sampled": Drafts("tree", gives_probs=True, without_replacement=True),  # b draws from q per node
    "dynamic": Drafts("tree"),  # best nodes by cumulative log q: not draws
}


@dataclass
class _State:
    slot: int  # this sequence's slot in the head's cache
    params: SamplingParams
    rng: PositionalRandom  # the request's drafting streams (coupled: its TOKEN draws, capabilities.py)
    pending: PendingRows  # [m, H] fused features of committed positions not yet written
    rows: int = 0  # committed head rows in the cache
    last_hidden: torch.Tensor | None = None  # [H] output hidden of row rows-1
    last_logits: torch.Tensor | None = None  # [Vd] its logits
    shift: int = 0  # positions minus cache rows past the sink (a window reclaimed the rows between)


class Eagle3Drafter(DrafterBase):
    """Drafts with an EAGLE-3 head; `capabilities.needs_hidden` are this head's target layers.
    batched=False drafts each sequence with forwards of its own (the slow reference, grow.py)."""

    def __init__(self, head: Eagle3Head, shape: TreeShape, taps: tuple[int, ...], name: str = "eagle3",
                 batched: bool = True, window: Window | None = None):
        self.window = window
        self.head = head
        self.shape = shape
        self.name = name
        self.batched = batched
        self.capabilities = Capabilities(trees=TREES, needs_hidden=tuple(taps), couples=True)
        self.vocab = head.config.vocab_size
        self.slots = SlotCache(head.new_cache)
        self._states: dict[int, _State] = {}

    @property
    def cache(self):
        return self.slots.cache

    @property
    def cache_rows(self) -> int:
        """Rows a slot of the head's cache holds (grown by doubling)."""
        return self.slots.cache.max_len

    # -- protocol -----------------------------------------------------------------------------
    def max_nodes(self, depth: int) -> int:
        return self.shape.max_drafts(depth)

    def start(self, seq_id: int, prompt: list[int], params: SamplingParams | None = None,
              hidden: torch.Tensor | None = None, coupled: bool = False) -> None:
        """hidden: [len(prompt) - 1, 3, Ht] the prompt's features at the declared layers (the
        last prompt token is the first root: its features come with the first round); None
        for a one-token prompt. Takes a slot and writes the prompt's rows. coupled: draw the
        sampled chain with the verifier's own token uniforms (capabilities.py `couples`)."""
        params = params or SamplingParams()
        rows = 0 if hidden is None else hidden.shape[0]
        if rows != len(prompt) - 1:
            got = None if hidden is None else tuple(hidden.shape)
            raise ValueError(f"eagle3 start needs the prompt's features [{len(prompt) - 1}, 3, Ht], got {got}")
        self.finish(seq_id, prompt)  # a state left by an interrupted run gives its slot back
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**63 - 1, ()))
        pending = self.head.fuse(hidden) if rows else self.head.w.norm.new_zeros(0, self.head.config.hidden_size)
        rng = PositionalRandom(seed) if coupled else PositionalRandom(seed).drafting()  # else apart from the verifier's
        st = _State(self.slots.take(), params, rng, PendingRows(pending))
        self._states[seq_id] = st
        if self.window is None:
            return  # the prompt's rows are written at the first proposal, with the rows added by then
        chunk = self.window.chunk  # in chunks, the dead rows reclaimed between
        for upto in range(min(chunk, rows), rows, chunk):
            st.pending = PendingRows(pending[st.rows : upto])
            self.slots.ensure_rows(st.rows - st.shift + chunk + 1)
            self._catch_up([st], [prompt[: upto + 1]])
            self._reclaim(st)
        st.pending = PendingRows(pending[st.rows :])
        self.slots.ensure_rows(st.rows - st.shift + st.pending.rows + 1)
        self._catch_up([st], [prompt])

    def update(self, seq_id: int, result: VerifyResult, hidden: torch.Tensor | None = None) -> None:
        """hidden: [1 + num_accepted, 3, Ht] the target's features of the root and accepted nodes."""
        if hidden is None or hidden.shape[0] != 1 + result.num_accepted:
            got = None if hidden is None else tuple(hidden.shape)
            raise ValueError(f"eagle3 update needs the accepted path's features [{1 + result.num_accepted}, 3, Ht], "
                             f"got {got}")
        st = self._states[seq_id]
        st.pending.add(self.head.fuse(hidden))

    def finish(self, seq_id: int, tokens: list[int]) -> None:
        st = self._states.pop(seq_id, None)
        if st is not None:
            self.slots.give(st.slot)

    def propose(self, seq_id: int, tokens: list[int], budget: Budget) -> DraftTree:
        return self.propose_batch([seq_id], [tokens], [budget])[0]

    def propose_batch(self, seq_ids: list[int], tokens: list[list[int]], budgets: list[Budget]) -> list[DraftTree]:
        """A tree per sequence: one catch-up forward, then one forward per draft depth for all."""
        states = [self._states[s] for s in seq_ids]
        depths = [self.shape.max_depth(b.depth) for b in budgets]
        for st in states:
            self._reclaim(st)
        self.slots.ensure_rows(max(len(t) - st.shift + self.shape.fed_nodes(d) + 1
                                   for st, t, d in zip(states, tokens, depths)))
        self._catch_up(states, tokens)
        growers = [self._grower(st, toks, depth, budget)
                   for st, toks, depth, budget in zip(states, tokens, depths, budgets)]

        def forward(indices: list[int], feeds: list[Feed]) -> list[tuple[torch.Tensor, torch.Tensor]]:
            chosen = [states[i] for i in indices]
            return self._forward([st.slot for st in chosen], [st.rows - 1 for st in chosen], feeds,
                                 shifts=[st.shift for st in chosen])

        return (grow_together if self.batched else grow_alone)(growers, forward)

    def _grower(self, st: _State, tokens: list[int], depth: int, budget: Budget) -> Grower:
        if st.rows == 0 or depth < 1 or budget.nodes < 1:  # a one-token prompt: no feature yet
            return done(DraftTree.root_only(tokens[-1]))
        if self.shape.is_chain:
            return self._chain(st, tokens, min(depth, budget.nodes), budget.min_confidence, budget.stop)
        if self.shape.kind == "sampled" and not st.params.greedy:
            return self._sampled(st, tokens, depth, budget.nodes, budget.min_confidence)
        return self._tree(st, tokens[-1], depth, budget.nodes, budget.min_confidence)

    # -- the head's forward -------------------------------------------------------------------
    def _forward(self, slots: list[int], starts: list[int], feeds: list[Feed], last_only: bool = False,
                 shifts: list[int] | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One head forward: feeds[b]'s nodes at positions starts[b] + node of slot slots[b] (a
        tree's node 0 is position starts[b]; parents None: causal rows), at cache rows less
        shifts[b] (a window's). The head takes the span of slots in order, so slots between that
        do not feed come as empty rows. Returns (logits [n, Vd], hidden [n, H]) per feed; with
        `last_only`, of its last node alone ([1, Vd], [1, H])."""
        lo, hi = min(slots), max(slots)
        at = {slot: b for b, slot in enumerate(slots)}
        span = range(lo, hi + 1)
        empty = Feed([], None, 0, None)
        rows = [feeds[at[s]] if s in at else empty for s in span]
        shifts = shifts or [0] * len(slots)
        span_shifts = [shifts[at[s]] if s in at else 0 for s in span]
        window = {} if self.window is None else {"shifts": span_shifts, "window": self.window.mask_args()}
        batch = pack(list(span), [starts[at[s]] - shifts[at[s]] if s in at else 0 for s in span],
                     [torch.tensor(f.tokens, dtype=torch.long) for f in rows],
                     [None if f.parents is None else torch.tensor(f.parents) for f in rows],
                     scratch_row=self.cache.scratch_row, device=self.head.device,
                     first_nodes=[f.first for f in rows], **window)
        inputs = self.head.w.norm.new_zeros(len(span), batch.tokens.shape[1], self.head.config.hidden_size)  # [S, T, H]
        for i, f in enumerate(rows):
            if f.tokens:
                inputs[i, : len(f.tokens)] = f.inputs
        if last_only:
            last = torch.tensor([max(len(f.tokens) - 1, 0) for f in rows])  # [S]
            logits, hidden = self.head.forward(batch, self.cache, inputs, last)  # [S, 1, Vd], [S, 1, H]
            return [(logits[s - lo], hidden[s - lo]) for s in slots]
        logits, hidden = self.head.forward(batch, self.cache, inputs)  # [S, T, Vd], [S, T, H]
        return [(logits[s - lo, : len(f.tokens)], hidden[s - lo, : len(f.tokens)]) for s, f in zip(slots, feeds)]

    def _catch_up(self, states: list[_State], tokens: list[list[int]]) -> None:
        """Write the committed rows whose features arrived, for every sequence in one forward:
        row p gets token p + 1."""
        todo = []
        for st, toks in zip(states, tokens):
            m = st.pending.rows
            if st.rows + m != len(toks) - 1:
                raise ValueError(f"eagle3 drafter out of step: {st.rows} rows + {m} pending features for "
                                 f"{len(toks)} committed tokens (expected {len(toks) - 1} rows)")
            if m:
                todo.append((st, Feed(toks[st.rows + 1:], None, 0, st.pending.joined())))
        if not todo:
            return
        outs = self._forward([st.slot for st, _ in todo], [st.rows for st, _ in todo], [f for _, f in todo],
                             last_only=True, shifts=[st.shift for st, _ in todo])
        for (st, feed), (logits, hidden) in zip(todo, outs):
            st.rows += len(feed.tokens)
            self.cache.set_length(st.slot, st.rows - st.shift)
            st.pending.clear()
            st.last_hidden, st.last_logits = hidden[-1], logits[-1]

    def _reclaim(self, st: _State) -> None:
        """A window's dead rows of this sequence, dropped once there are enough (window.py)."""
        if self.window is not None:
            _, st.shift = reclaim(self.window, self.cache, st.slot, st.rows - st.shift, st.shift)

    # -- drafting, one sequence (a grower: yields the nodes to feed, grow.py) -------------------
    def _chain(self, st: _State, tokens: list[int], k: int, min_confidence: float = 0.0, stop=None) -> Grower:
        """Up to k drafts; after the first whose path confidence falls below `min_confidence`, or
        after which `stop(entropies)` says so (Budget.stop: the entropies, nats, of the head's
        distributions over its draft vocabulary the drafts so far came from, as
        drafters/model_growers.py reports them), no deeper one is drafted (that one is kept:
        dropping a sampled draft for its own probability would bias the drafts the verifier sees
        as draws from q; the entropy of the distribution a draft came from does not depend on
        the draft drawn)."""
        sampling = not st.params.greedy
        rng = st.rng.at(len(tokens))  # offset d - 1: the token at depth d
        logits, hidden = st.last_logits, st.last_hidden
        drafts, qs, confidence, entropies = [], [], [1.0], []
        for d in range(1, k + 1):
            if sampling:
                q = warp_probs(self.head.target_logits(logits), st.params)  # over [V]
                token = rng.categorical(q, offset=d - 1)
                qs.append(q)
                confidence.append(confidence[-1] * float(q[token]))
            else:
                token = self.head.greedy_token(logits)
                share = torch.exp(logits.float().max() - logits.float().logsumexp(-1))  # its softmax share
                confidence.append(confidence[-1] * float(share))
            drafts.append(token)
            halt = False
            if stop is not None:  # told every draft's entropy, the last one's too
                logp = torch.log_softmax(logits.float(), dim=-1)  # [Vd]
                entropies.append(float(-(logp.exp() * logp).sum()))
                halt = stop(entropies)
            if d < k and confidence[-1] >= min_confidence and not halt:
                out_logits, out_hidden = yield Feed([token], list(range(-1, d)), d, hidden.unsqueeze(0))
                logits, hidden = out_logits[0], out_hidden[0]
            else:
                break
        probs = None
        if sampling:
            probs = torch.zeros(len(drafts) + 1, self.vocab)
            probs[: len(drafts)] = torch.stack(qs).cpu()
        return replace(DraftTree.chain(tokens[-1], drafts, probs), confidence=torch.tensor(confidence))

    def _sampled(self, st: _State, committed: list[int], depth: int, max_nodes: int,
                 min_confidence: float = 0.0) -> Grower:
        """b children per node drawn from q (the head's warped distribution over the target
        vocabulary) without replacement (siblings.py), q kept for the verifier; a node whose path
        confidence is below `min_confidence` gets none (a rule on its own path, never on which of
        its siblings were drawn)."""
        rng = st.rng.at(len(committed))  # offset d: the tokens at depth d + 1
        tokens, parents, confidence, qs = [committed[-1]], [-1], [1.0], {}
        frontier = [0]
        logits, hidden = st.last_logits.unsqueeze(0), st.last_hidden.unsqueeze(0)  # [f, Vd], [f, H]
        for d in range(depth):
            new, inputs = [], []
            for row, node in enumerate(frontier):
                if len(tokens) - 1 >= max_nodes:
                    break
                q = warp_probs(self.head.target_logits(logits[row]), st.params)  # [V]
                qs[node] = q
                for token, share in draw_siblings(q, min(self.shape.branching[d], max_nodes - len(tokens) + 1), rng, d):
                    tokens.append(token)
                    parents.append(node)
                    confidence.append(confidence[node] * share)
                    new.append(len(tokens) - 1)
                    inputs.append(row)
            if not new or d == depth - 1 or max(confidence[i] for i in new) < min_confidence:
                break
            first = new[0]
            out_logits, out_hidden = yield Feed(tokens[first:], list(parents), first, hidden[inputs])
            keep = [j for j, i in enumerate(new) if confidence[i] >= min_confidence]
            frontier = [new[j] for j in keep]
            logits, hidden = out_logits[keep], out_hidden[keep]
        probs = torch.zeros(len(tokens), self.vocab)
        for node, q in qs.items():
            probs[node] = q.cpu()
        return DraftTree(torch.tensor(tokens), torch.tensor(parents), probs, torch.tensor(confidence))

    def _tree(self, st: _State, root: int, depth: int, max_nodes: int, min_confidence: float = 0.0) -> Grower:
        """Static (top-b of every node) or dynamic (EAGLE-2) trees, grown one depth per forward;
        a node whose path confidence is below `min_confidence` is not expanded.

        cand[i] = (target token, parent cand id, cumulative log q); cand 0 is the root. Expanded
        candidates are fed to the head as a tree of their own (`fed`, node 0 the root's row)."""
        dynamic = self.shape.kind == "dynamic"
        floor = math.log(min_confidence) if min_confidence > 0 else -math.inf
        if dynamic:
            max_nodes = min(max_nodes, self.shape.max_nodes)
        cand: list[tuple[int, int, float]] = [(root, -1, 0.0)]
        fed_of = {0: 0}  # cand id -> node in the fed tree
        fed_tokens, fed_parents = [root], [-1]
        frontier = [0]
        logits, hidden = st.last_logits.unsqueeze(0), st.last_hidden.unsqueeze(0)  # [f, Vd], [f, H]
        for d in range(depth):
            width = self.shape.top_k if dynamic else self.shape.branching[d]
            logp = torch.log_softmax(logits.float(), dim=-1)
            top = logp.topk(min(width, logp.shape[-1]), dim=-1)
            ids = self.head.target_ids(top.indices).tolist()
            children = []
            for row, cid in enumerate(frontier):
                for lp, token in zip(top.values[row].tolist(), ids[row]):
                    if not dynamic and len(cand) - 1 >= max_nodes:
                        break
                    cand.append((token, cid, cand[cid][2] + lp))
                    children.append(len(cand) - 1)
            expand = heapq.nlargest(self.shape.top_k, children, key=lambda c: cand[c][2]) if dynamic else children
            expand = [c for c in expand if cand[c][2] >= floor]
            if d == depth - 1 or not expand:
                break
            first = len(fed_tokens)
            for cid in expand:
                fed_of[cid] = len(fed_tokens)
                fed_tokens.append(cand[cid][0])
                fed_parents.append(fed_of[cand[cid][1]])
            rows = {cid: i for i, cid in enumerate(frontier)}
            inputs = hidden[[rows[cand[cid][1]] for cid in expand]]  # [e, H]: each parent's output
            logits, hidden = yield Feed(fed_tokens[first:], list(fed_parents), first, inputs)
            frontier = expand
        chosen = range(1, len(cand))
        if dynamic:
            best = set(heapq.nlargest(max_nodes, chosen, key=lambda c: cand[c][2]))
            chosen = [c for c in chosen if c in best and ancestors_kept(cand, c, best)]
        index, tokens, parents = {0: 0}, [root], [-1]
        for c in chosen:  # cand ids grow with depth: parents come first
            index[c] = len(tokens)
            tokens.append(cand[c][0])
            parents.append(index[cand[c][1]])
        confidence = torch.tensor([0.0] + [cand[c][2] for c in chosen]).exp()  # cumulative log q -> path probability
        return DraftTree(torch.tensor(tokens), torch.tensor(parents), confidence=confidence)


# -- registration ---------------------------------------------------------------------------------
def build(path: str, shape: TreeShape, target, target_path: Path) -> Eagle3Drafter:
    path, window, vocab = argument_options(path)
    folder, asked = split_dtype(path)
    dtype = head_dtype(asked, target)
    keep = None if vocab is None else draft_vocab_ids(target_path, vocab, target.config.vocab_size)
    head = load_eagle3(folder, target, quantize=dtype, vocab=keep)
    return Eagle3Drafter(head, shape, head.config.taps(target.config.num_layers),
                         name=f"eagle3:{folder}" + (f"@{dtype}" if dtype else "") + (f",{window}" if window else "")
                         + (f",vocab={vocab}" if vocab else ""), window=window)


register(DrafterEntry("eagle3", USAGE, Capabilities(trees=TREES, couples=True), build=build,
                      parse_argument=parse_argument, check_fits=check_fits, windowed=True))
