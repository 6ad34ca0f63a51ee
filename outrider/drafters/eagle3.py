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

from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..heads.eagle3.head import Eagle3Head
from ..heads.eagle3.format import load_eagle3
from ..models.batch import pack
from ..sampling import SamplingParams, warp_probs
from ..spec.random import PositionalRandom
from ..spec.shapes import TreeShape
from ..spec.types import Budget, DraftTree, VerifyResult
from .base import DrafterBase
from .capabilities import Capabilities, Drafts
from .draft_model import draft_vocab_ids
from .eagle3_options import USAGE, argument_options, check_fits, head_dtype, parse_argument, split_dtype  # noqa: F401 (tests)
from .grow import Feed, done, grow_alone, grow_together
from .model_growers import TreeGrowers
from .pending import PendingRows
from .registry import DrafterEntry, register
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
    base: int = 0  # the round's root position (committed tokens - 1): the grower's draws count from it
    fed: set = field(default_factory=set)  # the round's tree nodes a forward wrote (the grower's record)


class Eagle3Drafter(TreeGrowers, DrafterBase):
    """Drafts with an EAGLE-3 head; `capabilities.needs_hidden` are this head's target layers.
    Trees grow by the model drafters' growers (model_growers.py), fed each parent's output hidden.
    batched=False drafts each sequence with forwards of its own (the slow reference, grow.py)."""

    def __init__(self, head: Eagle3Head, shape: TreeShape, taps: tuple[int, ...], name: str = "eagle3",
                 batched: bool = True, window: Window | None = None):
        self.window = window
        self.head = head
        self.shape = shape
        self.name = name
        self.batched = batched
        self.capabilities = Capabilities(trees=TREES, needs_hidden=tuple(taps), couples=True)
        self.target_vocab = head.config.vocab_size
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
        for st, toks in zip(states, tokens):
            st.base, st.fed = len(toks) - 1, {0}
        growers = [self._grower(st, toks[-1], (st.last_logits, st.last_hidden), depth, budget) if st.rows
                   else done(DraftTree.root_only(toks[-1]))  # a one-token prompt: no feature yet
                   for st, toks, depth, budget in zip(states, tokens, depths, budgets)]

        def forward(indices: list[int], feeds: list[Feed]) -> list[tuple[torch.Tensor, torch.Tensor]]:
            chosen = [states[i] for i in indices]
            return self._forward([st.slot for st in chosen], [st.rows - 1 for st in chosen], feeds,
                                 shifts=[st.shift for st in chosen])

        return (grow_together if self.batched else grow_alone)(growers, forward)

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

    # -- what a node's output means to the growers (model_growers.py) -------------------------
    def _q(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """q: the head's warped distribution over the target vocabulary [V] from draft logits [Vd]."""
        return warp_probs(self.head.target_logits(logits), params)

    def _columns(self, logits: torch.Tensor) -> torch.Tensor:
        return logits  # [..., Vd]: every draft id is a target token

    def _tokens(self, columns: torch.Tensor) -> list:
        return self.head.target_ids(columns).tolist()

    def _greedy(self, logits: torch.Tensor) -> int:
        return self.head.greedy_token(logits)

    def _split(self, out):
        return out  # (logits [n, Vd], output hidden [n, H]): the hidden goes with each child fed


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
