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

Drafting by shape (chain, static, sampled and dynamic trees): model_growers.py, one depth per
forward with the tree's ancestor mask.

With a `window` (window.py, `draft-model:NAME,window=W,sink=S`) the draft model attends to its
sink and its last W positions only, and its own cache keeps only those rows: a sequence's
positions (st.cached, st.base: token counts) are its cache rows plus `st.shift` past the sink.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ..errors import ConfigError
from ..models.batch import pack
from ..models.decoder import Decoder
from ..sampling import SamplingParams
from ..spec.random import PositionalRandom
from ..spec.shapes import TreeShape
from ..spec.tree import children as children_of
from ..spec.types import Budget, DraftTree, VerifyResult
from .base import DrafterBase
from .capabilities import Capabilities, Drafts
from .grow import Feed, grow_alone, grow_together
from .model_growers import TreeGrowers
from .slots import SlotCache
from .window import Window, reclaim


@dataclass
class ModelDraftState:
    slot: int  # this sequence's slot in the drafter's cache
    params: SamplingParams
    rng: PositionalRandom  # the request's drafting streams (sampled chains draw from q); coupled: its TOKEN draws
    cached: int = 0  # rows of committed tokens in the cache
    base: int = 0  # len(tokens) - 1 at the last proposal: row of the root
    fed: set[int] = field(default_factory=set)  # tree nodes whose K/V this round wrote
    proposed: bool = False  # a proposal since the last update (a round may skip the drafter)
    tree: tuple[list[int], list[int]] = ((), ())  # the proposed tree's tokens and parents
    shift: int = 0  # positions minus cache rows past the sink (a window reclaimed the rows between)


class ModelDrafter(TreeGrowers, DrafterBase):
    """Drafts with a `Decoder` of its own (or the target's first layers); registered as the
    `draft-model` (draft_model.py) and `early-exit` (early_exit.py) drafters.

    batched=False drafts each sequence with forwards of its own (the slow reference, grow.py)."""

    capabilities = Capabilities(trees={
        "chain": Drafts("chain", gives_probs=True),  # sampled: each draft drawn from q, q kept
        "static": Drafts("tree"),  # top-b children of q: not draws
        "sampled": Drafts("tree", gives_probs=True, without_replacement=True),  # b draws from q per node
        "dynamic": Drafts("tree"),  # best nodes by cumulative log q: not draws
    }, couples=True)

    def __init__(self, decoder: Decoder, shape: TreeShape, *, num_layers: int | None = None,
                 name: str = "draft-model", target_vocab: int | None = None, batched: bool = True,
                 share_target_cache: bool = False, window: Window | None = None):
        """share_target_cache: `decoder` is the target and drafts over the target's cache once
        the engine attaches it (early exit; see the module's notes). window: attend to a sink and
        the last W positions only, in a bounded cache of its own (window.py)."""
        if window is not None and share_target_cache:
            raise ValueError(f"{name}: a window needs a cache of the drafter's own, not the target's")
        if window is not None and decoder.config.delta is not None:
            raise ConfigError(f"{name}: a window drops K/V rows, and this model's gated-delta layers keep a "
                              "recurrent state instead; drop window=")
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
        self._states: dict[int, ModelDraftState] = {}

    @property
    def slots(self) -> SlotCache:
        if self._slots is None:
            layers = self.num_layers or self.decoder.config.num_layers
            # a window= reclaims rows by moving them down past a sliding layer's window: every row kept
            rings = self.window is None
            self._slots = SlotCache(lambda n, rows: self.decoder.new_cache(n, rows, num_layers=layers, rings=rings))
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

    def _roll_back(self, committed: dict[int, int]) -> None:
        """A drafter that writes its rows into the target's cache (s2moe, draftexpert) drops them
        before verification: each slot's length back to its committed prefix (the root's row),
        where the verify forward starts writing."""
        for slot, length in committed.items():
            self.target_cache.set_length(slot, length)

    def _hold(self, states: list[ModelDraftState], ends: list[int]) -> None:
        """Over the target's cache, the slots' lengths cover the rows the draft has written."""
        if self.target_cache is not None:
            for st, end in zip(states, ends):
                self.target_cache.set_length(st.slot, max(self.target_cache.lengths[st.slot], end))

    # -- protocol -----------------------------------------------------------------------------
    def max_nodes(self, depth: int) -> int:
        return self.shape.max_drafts(depth)

    def start(self, seq_id: int, prompt: list[int], params: SamplingParams | None = None,
              target_slot: int | None = None, coupled: bool = False) -> None:
        """Take a slot and write the prompt's K/V but the last token's (the first round's root);
        over the target's cache, use the sequence's `target_slot`, whose prompt rows the
        target's prefill wrote. coupled: draw the sampled chain with the verifier's own token
        uniforms (capabilities.py `couples`; the engine asks for it under a walk only)."""
        params = params or SamplingParams()
        self.finish(seq_id, prompt)  # a state left by an interrupted run gives its slot back
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**63 - 1, ()))
        rng = PositionalRandom(seed) if coupled else PositionalRandom(seed).drafting()  # else apart from the verifier's
        if self.target_cache is not None:
            if target_slot is None:
                raise ValueError(f"{self.name} drafts over the target's cache: start() needs the sequence's target_slot")
            self._states[seq_id] = ModelDraftState(target_slot, params, rng, cached=len(prompt) - 1)
            return
        st = ModelDraftState(self.slots.take(), params, rng)
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
    def _reclaim(self, st: ModelDraftState) -> None:
        """A window's dead rows of this sequence, dropped once there are enough (window.py)."""
        if self.window is not None:
            rows, st.shift = reclaim(self.window, self.cache, st.slot, st.cached - st.shift, st.shift)

    def _windowed(self, states: list[ModelDraftState]) -> dict:
        """pack's window arguments for these sequences (none without a window)."""
        if self.window is None:
            return {}
        return {"shifts": [st.shift for st in states], "window": self.window.mask_args()}

    @property
    def cache_rows(self) -> int:
        """Rows a slot of the drafter's own cache holds (grown by doubling; 0 over the target's)."""
        return 0 if self.target_cache is not None or self._slots is None else self._slots.cache.max_len

    def _forward(self, states: list[ModelDraftState], feeds: list[Feed]) -> list[torch.Tensor]:
        """One forward writing each sequence's fed tree nodes; returns their logits [n_b, vocab]."""
        batch = pack([st.slot for st in states], [st.base - st.shift for st in states],
                     [torch.tensor(f.tokens) for f in feeds], [torch.tensor(f.parents) for f in feeds],
                     logits="real", scratch_row=self.cache.scratch_row, device=self.decoder.device,
                     first_nodes=[f.first for f in feeds], **self._windowed(states))
        logits = self.decoder.forward(batch, self.cache, num_layers=self.num_layers).logits  # [sum n_b, vocab]
        return list(logits.split([len(f.tokens) for f in feeds]))

    def _catch_up(self, states: list[ModelDraftState], tokens: list[list[int]]) -> torch.Tensor:
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
