"""An exact prefix cache: the K/V of full blocks of P tokens, kept after a request's prefill and at
its end, found again by the whole token prefix before them, and copied into a new request's slot
rows (or, over paged K/V, shared as pages) so that only the rest of its prompt is prefilled.

    cache = PrefixCache(block=16, budget_bytes=512 << 20)
    n = cache.restore(state, slot, tokens)   # rows 0..n-1 of `slot` now hold the K/V of tokens[:n]:
                                             # the longest cached prefix of whole blocks (n % P == 0)
    cache.store(state, slot, tokens)         # the slot's rows 0..len(tokens)-1, block by block

Keys are a chain: block i of a sequence is found by (the serial of block i - 1, its P tokens), so
a block is reached only through the prefix it was computed after, and the dict compares the
tokens themselves (no hash collision can return another prompt's rows). Serials are never
reused; a block evicted takes the blocks after it along (they could no longer be reached).

The pool: per K/V tensor of the slot state ([slots, heads, rows, width]: a KVCache's k and v per
layer, a LatentCache's latents), one tensor [blocks, heads, P, width] of its dtype, allocated
with `torch.empty` to the budget when the first block is stored (the OS commits its pages as
blocks are written). A restore is one index_select and one copy per tensor.

Paged K/V (models/paged_cache.py) with pages of P rows: no pool of its own. A block is a page of
the K/V pool, held by reference (the page's count, one for the cache): `store` takes the slot's
own pages (no copy), `restore` puts the cached pages at the head of the new slot's block table
(PagedKVCache.share, no copy); a request that writes into a shared page copies it first (copy on
write), and a page is free when its last holder drops it (the cache on eviction, a slot at its
end). The cache's budget caps its pages; when the pool runs short, the pages only the cache holds
go first, least recent first (PagedKVCache.reclaim), before a request waits or is preempted. A new
pool (LLM.generate makes an engine a call) gets the most recent blocks copied over once.
A block size other than the page size keeps the pool of its own and copies.

Eviction: least recently used first, among blocks no one holds (`refs`: a restore holds its
blocks while it copies them). A lookup touches the blocks it matched from the deepest up, so a
block is always more recent than the blocks after it and the least recent block is a leaf.

Exact: the rows copied are the bits the prefill (or decoding) computed; they equal a whole
prefill's only where the prefill gives the same bits in any chunks. `why_not_exact` says where
that does not hold (the engine then keeps the cache off and says why): a prefill through the
torch layers or the float GEMM (config gemm_prefill=on) or the AMX tiles, whose summation order
depends on how many rows a forward holds; and a slot state that is not K/V rows by position:
recurrent (gated-delta) layers, whose state at a block boundary is not kept, or sliding-window
rings. Where the GEMM was only the CPU's default (gemm_prefill=auto, Intel), an engine with the
cache prefills in the native layer instead and keeps the cache on (`exact_prefill`): the fill
kernel's bits do not depend on the chunk, the GEMM's do (the rows under 96 take another kernel,
MKL's sgemm splits its sums by the row count at two threads, and torch's attention over a whole
prompt and over a chunk with a mask are different kernels: docs/serving.md, "Prefix cache").
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from ..kernels import dispatch
from ..kernels.dispatch import PrefillPath
from ..models.batch import pack
from ..models.kv_cache import KVCache

DEFAULT_BLOCK = 16  # tokens a block (vLLM's default block size)
PROBE_ROWS = (1, dispatch.TILE_ROWS, dispatch.BULK_ROWS, 256)  # prefill sizes on each side of the paths' thresholds


@dataclass(eq=False)
class Block:
    serial: int  # never reused: the key of the blocks after it
    parent: int  # the serial of the block before it (-1: the first block of a prompt)
    tokens: tuple[int, ...]  # its P tokens
    row: int  # its place in the pool
    refs: int = 0
    children: set[int] = field(default_factory=set)


class PrefixCache:
    def __init__(self, block: int = DEFAULT_BLOCK, budget_bytes: int = 512 << 20):
        if block < 1 or budget_bytes < 0:
            raise ValueError(f"a prefix cache needs a block of at least 1 token and a budget >= 0, got {block}, "
                             f"{budget_bytes}")
        self.block = block
        self.budget_bytes = budget_bytes
        self.pool: list[torch.Tensor] | None = None  # per state tensor: [capacity, heads, P, width]
        self.pages = None  # paged K/V whose pages the blocks are (held by reference), or None
        self.capacity = 0  # blocks the pool holds
        self._index: dict[tuple[int, tuple[int, ...]], Block] = {}  # (parent serial, tokens) -> block
        self._lru: OrderedDict[int, Block] = OrderedDict()  # serial -> block, least recent first
        self._free: list[int] = []  # pool rows
        self._serial = 0
        self.queries = 0  # prompt tokens of the requests looked up (vLLM's prefix_cache_queries)
        self.hits = 0  # of those, tokens restored from the cache (prefix_cache_hits)

    # -- what the engine calls --------------------------------------------------------------------
    def restore(self, state: KVCache, slot: int, tokens: list[int]) -> int:
        """Copy the K/V of the longest cached prefix of `tokens` made of whole blocks into rows
        0..n-1 of `slot`; returns n (0: nothing cached). The slot's length is the caller's."""
        if self.shares(state):  # pages by reference: no copy
            blocks = self._match(tokens) if self._pool_for(state) else []
            if blocks:
                state.share(slot, [b.row for b in blocks])
            return len(blocks) * self.block
        blocks = self._match(tokens)
        if not blocks:
            return 0
        n = len(blocks) * self.block
        self._hold(blocks, 1)
        try:
            rows = torch.tensor([b.row for b in blocks], device=self.pool[0].device)
            got = [kept.index_select(0, rows).permute(1, 0, 2, 3) for kept in self.pool]  # [heads, m, P, width]
            if getattr(state, "paged", False):  # into the slot's pages (copied: a block is not a page)
                layers = len(got) // 2
                for layer in range(layers):
                    k, v = got[layer], got[layers + layer]
                    state.write_slot(layer, slot, 0, k.reshape(k.shape[0], n, k.shape[3]),
                                     v.reshape(v.shape[0], n, v.shape[3]))
            else:
                for own, kept in zip(_tensors(state), got):
                    own[slot, :, :n] = kept.reshape(own.shape[1], n, own.shape[3])
        finally:
            self._hold(blocks, -1)
        return n

    def store(self, state: KVCache, slot: int, tokens: list[int]) -> int:
        """Keep rows 0..len(tokens)-1 of `slot` (the K/V of `tokens`) as whole blocks, those not
        cached yet, evicting unheld blocks least recent first when the pool is full; returns the
        blocks added (fewer than asked when the pool holds too few)."""
        whole = len(tokens) // self.block
        if whole == 0 or not self._pool_for(state):
            return 0
        shares = self.shares(state)
        chain = self._match(tokens)
        self._hold(chain, 1)  # not evicted to make room for their own continuation
        added = []  # held too while the store goes on (a store past the budget stops, not evicts its own)
        try:
            parent = chain[-1].serial if chain else -1
            for i in range(len(chain), whole):
                row = self._take_row()
                if row is None:
                    break
                if shares:  # the slot's own page, held by the cache too
                    row = state.held[slot][i]
                    state.hold(row)
                key = (parent, tuple(tokens[i * self.block:(i + 1) * self.block]))
                block = Block(self._serial, parent, key[1], row)
                self._serial += 1
                if parent >= 0:
                    self._lru[parent].children.add(block.serial)
                self._index[key] = block
                self._lru[block.serial] = block
                block.refs += 1
                added.append(block)
                parent = block.serial
            if added and not shares:
                first, m = len(chain) * self.block, len(added) * self.block
                rows = torch.tensor([b.row for b in added], device=self.pool[0].device)
                for own, kept in zip(_tensors(state), self.pool):
                    part = (state.slot_rows(own, slot, first, m) if getattr(state, "paged", False)
                            else own[slot, :, first:first + m])  # [heads, m, width]
                    kept.index_copy_(0, rows, part.reshape(part.shape[0], len(added), self.block, part.shape[2])
                                     .permute(1, 0, 2, 3))
            self._touch(chain + added)
        finally:
            self._hold(chain + added, -1)
        return len(added)

    def record(self, queried: int, hit: int) -> None:
        """Count one request looked up: its prompt's tokens and those restored."""
        self.queries += queried
        self.hits += hit

    @property
    def blocks(self) -> int:
        """Blocks held now."""
        return len(self._lru)

    def usage(self) -> float:
        """The pool's fraction in use (0 before the first store)."""
        return len(self._lru) / self.capacity if self.capacity else 0.0

    def describe(self) -> str:
        return f"prefix cache: blocks of {self.block} tokens, {self.budget_bytes / (1 << 20):g} MiB"

    # -- the chain, the LRU and the pool -------------------------------------------------------
    def _match(self, tokens: list[int]) -> list[Block]:
        """The cached blocks of tokens' longest prefix of whole blocks, first to last; touched."""
        blocks, parent = [], -1
        for i in range(len(tokens) // self.block):
            block = self._index.get((parent, tuple(tokens[i * self.block:(i + 1) * self.block])))
            if block is None:
                break
            blocks.append(block)
            parent = block.serial
        self._touch(blocks)
        return blocks

    def _touch(self, blocks: list[Block]) -> None:
        """Most recent now, the deepest first: a block stays more recent than the blocks after it."""
        for block in reversed(blocks):
            self._lru.move_to_end(block.serial)

    def _hold(self, blocks: list[Block], delta: int) -> None:
        for block in blocks:
            block.refs += delta

    def _take_row(self) -> int | None:
        """A free pool row, evicting the least recent unheld block (and the blocks after it); over
        pages, room for one more block (-1) or None."""
        if (len(self._lru) >= self.capacity) if self.pages is not None else not self._free:
            victim = next((b for b in self._lru.values() if b.refs == 0 and not b.children), None)
            if victim is None:
                return None
            self._evict(victim)
        return -1 if self.pages is not None else self._free.pop()

    def _reclaim(self, n: int) -> None:
        """PagedKVCache.reclaim: evict least recent leaves whose page only the cache holds, until n
        pages are free or none is left."""
        while n > 0:
            victim = next((b for b in self._lru.values()
                           if b.refs == 0 and not b.children and self.pages.refs[b.row] == 1), None)
            if victim is None:
                return
            self._evict(victim)
            n -= 1

    def _evict(self, block: Block) -> None:
        for child in list(block.children):
            if child in self._lru:
                self._evict(self._lru[child])
        del self._lru[block.serial]
        del self._index[(block.parent, block.tokens)]
        if block.parent in self._lru:
            self._lru[block.parent].children.discard(block.serial)
        if self.pages is not None:
            self.pages.drop(block.row)  # free if no slot holds it
        else:
            self._free.append(block.row)

    def shares(self, state) -> bool:
        """Whether blocks are `state`'s pages by reference: paged K/V with pages of a block, and no
        pool of copies made before."""
        return getattr(state, "paged", False) and state.page_size == self.block and self.pool is None

    def _bind(self, state) -> None:
        """The blocks become pages of `state`'s pool: the first one bound, or a new pool of the same
        model (the most recent blocks that fit copied over, the rest forgotten)."""
        old = self.pages
        if old is not None and (len(old.k), old.k[0].shape[0], old.k[0].shape[3], old.k[0].dtype) != (
                len(state.k), state.k[0].shape[0], state.k[0].shape[3], state.k[0].dtype):
            raise ValueError("this prefix cache holds another model's K/V: give each model its own")
        self.capacity = min(self.budget_bytes // state.page_bytes(), state.num_pages) if state.k else 0
        blocks = list(self._lru.values())  # least recent first: a block's parent is kept before it
        keep = min(len(blocks), self.capacity, state.free_pages) if old is not None else 0
        for block in blocks[: len(blocks) - keep]:
            if block.serial in self._lru:
                self._evict(block)
        if keep:
            kept = blocks[len(blocks) - keep:]
            src = torch.tensor([b.row for b in kept], device=state.k[0].device)
            for block, page in zip(kept, state.take(keep)):
                block.row = page
            dst = torch.tensor([b.row for b in kept], device=state.k[0].device)
            for new, was in zip((*state.k, *state.v), (*old.k, *old.v)):
                new[:, dst] = was[:, src]  # [G, keep, P, D]
        if old is not None:
            old.reclaim = None
        self.pages = state
        state.reclaim = self._reclaim

    def _pool_for(self, state: KVCache) -> bool:
        """The pool, allocated at the first store for `state`'s tensors; False when the budget
        holds no block. A state of another layout than the pool's is refused."""
        if self.shares(state):
            if self.pages is not state:
                self._bind(state)
            return self.capacity > 0
        tensors = _tensors(state)
        heads = 0 if getattr(state, "paged", False) else 1  # a page pool's [heads, pages, P, width]
        if self.pool is None:
            per_block = self.block * sum(t.shape[heads] * t.shape[3] * t.element_size() for t in tensors)
            self.capacity = self.budget_bytes // per_block if per_block else 0
            self.pool = [torch.empty((self.capacity, t.shape[heads], self.block, t.shape[3]), dtype=t.dtype,
                                     device=t.device) for t in tensors]
            self._free = list(range(self.capacity))[::-1]  # row 0 first
        if len(tensors) != len(self.pool) or any(
                (t.shape[heads], t.shape[3], t.dtype) != (p.shape[1], p.shape[3], p.dtype)
                for t, p in zip(tensors, self.pool)):
            raise ValueError("this prefix cache holds another model's K/V: give each model its own")
        return self.capacity > 0


def _tensors(state: KVCache) -> list[torch.Tensor]:
    """The state's K/V tensors, each [slots, heads, rows, width]."""
    return [*state.k, *state.v]


def exact_prefill(target, state) -> str | None:
    """An engine with the prefix cache asks this instead of why_not_exact: where the float GEMM
    would prefill only because config gemm_prefill is auto (Intel), the target prefills in the
    native layer instead (Decoder.exact_prefill: the fill kernel, the same bits whole, in any chunks
    or restored from the cache) and the cache is on; None then, else why it stays off (the target
    prefills as the CPU's rule says). The target keeps it: every later engine on it (with the cache
    or without) prefills alike, so their answers agree."""
    target.exact_prefill = True
    why = why_not_exact(target, state)
    if why is not None:
        target.exact_prefill = False
    return why


def why_not_exact(target, state) -> str | None:
    """Why a prefix restored from the cache would not be the bits of a whole prefill on this
    target and CPU (the cache is then off), or None."""
    if not isinstance(state, KVCache) and not getattr(state, "paged", False):
        kind = getattr(state, "NOT_ROWS", None) or ("recurrent gated-delta layers, whose state at a block "
                                                    "boundary is not kept, or sliding-window rings")
        return (f"this model's slot state ({type(state).__name__}) is not K/V rows by position ({kind}): "
                "the prefix cache is off for it")
    for rows in PROBE_ROWS:
        path = target.prefill_path(pack([0], [0], [torch.zeros(rows, dtype=torch.long)], logits="none"))
        if path is PrefillPath.NATIVE:
            continue
        plan = dispatch.plan()
        if plan.tiles:
            how = "take the AMX tiles (config amx_prefill)"
            fix = "--config amx_prefill=false"
        elif plan.gemm_prefill:
            how = "take the float GEMM (config gemm_prefill=on)"
            fix = "--config gemm_prefill=off"
        else:
            return ("prefills of this model run in the torch layers, whose K/V bits depend on how a prompt is "
                    "chunked: the prefix cache is off (it keeps only exact bits)")
        return (f"prefills here {how}, whose K/V bits depend on how a prompt is chunked: the prefix cache is off "
                f"(it keeps only exact bits); {fix} prefills in the native layer, the same bits whole or chunked, "
                "and turns it on")
    return None
