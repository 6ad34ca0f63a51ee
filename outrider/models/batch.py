"""One forward's input: a batch of slots, each with its own new tokens.

Slot b brings `num_new[b]` new tokens (padded to T). New token i sits at cache row
`cache_lens[b] + i`, has rotary position `positions[b, i]`, and attends to the slot's committed
rows `[0, cache_lens[b])` plus the new tokens that `tree_mask[b, i]` allows (causal when there is
no tree). Padded tokens write to the cache's scratch row and are seen by nobody.

Example (one slot, cache_len 7, tree parents [-1, 0, 0]):
    rows       7 8 9           positions  7 8 8
    tree_mask  [[1,0,0],[1,1,0],[1,0,1]]  -> node 2 sees rows 0..6, 7 and 9, not 8.

Slots need not be contiguous nor in order: the forward attends over the **span** of cache slots
`[span_first, span_first + span_size)` that covers them, as a view of the cache (no K/V copy);
`span_place[b]` is batch row b's place in the span (None when the slots are exactly the span,
in order). Span slots that are not in the batch (holes) get a query of zeros that sees one row,
and their output is dropped. Example: slots [5, 2] -> span 2..5, span_place [3, 0], holes 3, 4.

A windowed drafter (drafters/window.py) passes `window=(S, W)` and per-slot `shifts`: its cache
row r holds position r (r < S) or r + shift (rows past the sink were reclaimed), new tokens get
positions shifted the same way, and each query at position p sees only keys at positions < S or
> p - W, on top of the usual causal / tree rule.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..spec.tree import ancestor_mask, depths


@dataclass(frozen=True)
class ForwardBatch:
    slot_ids: list[int]  # host copy of the slots, one per row of the batch
    tokens: torch.Tensor  # [B, T] long
    positions: torch.Tensor  # [B, T] long, rotary positions
    rows: torch.Tensor  # [B, T] long, cache row each new token's K/V goes to (scratch row for padding)
    attn_mask: torch.Tensor | None  # [B, 1, T, kv_len] bool, None: plain causal over one slot
    kv_len: int  # attention reads cache rows [0, kv_len)
    logits_rows: torch.Tensor | None  # [B, R] long: rows of the new tokens to score; None: all
    hidden_layers: tuple[int, ...] = ()  # hidden states to return (0 = embeddings, l = after layer l)
    span_first: int = 0  # attention reads cache slots [span_first, span_first + span_size)
    span_size: int = 1
    span_place: torch.Tensor | None = None  # [B] long: batch row b is span row span_place[b]; None: b
    logits_flat: torch.Tensor | None = None  # [N] long: score only these rows of the flattened [B * T]
    # (pack's logits="real": every real row, no padding); the logits come back [N, vocab]
    # [B, kv_len] long: the position each cache row read holds (a tree's node its depth's, a windowed
    # drafter's shifted rows theirs: key_positions); None: row r holds position r. Read by sliding-window
    # layers only (models/sliding.py)
    key_pos: torch.Tensor | None = None
    # host ints, per batch row: its slot's length, one past the last cache row it writes (a drafter's
    # tree grown over forwards: nodes first.. past earlier ones); and whether the new rows are a run
    # meant to be committed whole: every slot's tokens causal from its length, no draft tree given (a
    # prompt, a catch-up; a verify's chain is a tree). Read by sliding layers kept in rings
    # (ring_attention.py); None / False where the batch was built by hand
    starts: tuple[int, ...] | None = None
    ends: tuple[int, ...] | None = None
    committed_run: bool = False
    # rows that replace token embeddings: flat row indices into [B * T] long [N], and their values [N, E]
    # (a vision-language model's image features: with_embeds); None: every row is its token's embedding
    embeds: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def fills_only(self) -> bool:
        """No logits asked for (pack's logits="none"): the forward only writes the cache (a
        prompt's prefill, a drafter catching up)."""
        return self.logits_flat is None and self.logits_rows is not None and self.logits_rows.shape[-1] == 0

    @property
    def slots(self) -> torch.Tensor:
        return torch.tensor(self.slot_ids, device=self.tokens.device)


def pack(
    slot_ids: list[int],
    cache_lens: list[int],
    new_tokens: list[torch.Tensor],
    parents: list[torch.Tensor | None] | None = None,
    logits: str | list[list[int]] = "all",
    hidden_layers: tuple[int, ...] = (),
    scratch_row: int = -1,
    device: torch.device | str = "cpu",
    first_nodes: list[int] | None = None,
    shifts: list[int] | None = None,
    window: tuple[int, int] | None = None,
) -> ForwardBatch:
    """Build a ForwardBatch from host-side lengths and per-slot tokens (and trees).

    new_tokens[b]: [n_b] long. parents[b]: tree parents, or None for a causal run.
    logits: "all", "real" (every real row and no padding: logits come back flat, [sum n_b, vocab],
    slot b's rows after slot b-1's), "last" (the last real token of each slot), "none", or
    explicit rows per slot.
    first_nodes[b] (default 0): the new tokens are nodes first..first+n_b-1 of the tree
    `parents[b]`; its earlier nodes were written by an earlier forward at rows
    cache_len + node (a drafter growing its tree one depth at a time).
    shifts[b] (default 0): positions minus cache rows past the sink; window (S, W): a query at
    position p sees keys at positions < S or > p - W only (module notes).
    """
    if shifts is not None or window is not None:
        if any(shifts or ()) and window is None:
            raise ValueError("shifts come with a window: rows past the sink were reclaimed by it")
        return _pack(slot_ids, cache_lens, new_tokens, parents, logits, hidden_layers, scratch_row, device,
                     first_nodes, shifts or [0] * len(slot_ids), window)
    if len(slot_ids) == 1 and not (first_nodes and first_nodes[0]) and isinstance(logits, str):
        tree = parents[0] if parents is not None else None
        n = int(new_tokens[0].shape[0])
        if tree is None or torch.equal(tree.cpu(), torch.arange(-1, n - 1)):  # causal: a chain or no tree
            return _one_chain(slot_ids[0], cache_lens[0], new_tokens[0], tree is not None, logits, hidden_layers,
                              device)
    return _pack(slot_ids, cache_lens, new_tokens, parents, logits, hidden_layers, scratch_row, device, first_nodes)


def _pack(slot_ids, cache_lens, new_tokens, parents, logits, hidden_layers, scratch_row, device,
          first_nodes, shifts=None, window=None) -> ForwardBatch:
    """pack's general case (any slots, tokens and trees; a window)."""
    B = len(slot_ids)
    counts = [int(t.shape[0]) for t in new_tokens]
    firsts = first_nodes or [0] * B
    T = max(counts)
    width = max(f + n for f, n in zip(firsts, counts))  # tree nodes visible this forward
    tokens = torch.zeros(B, T, dtype=torch.long)
    positions = torch.zeros(B, T, dtype=torch.long)
    rows = torch.full((B, T), scratch_row, dtype=torch.long)
    tree = torch.zeros(B, T, width, dtype=torch.bool)
    node_pos = torch.zeros(B, width, dtype=torch.long)  # each visible tree node's position less its slot's shift
    for b, (n, start, first) in enumerate(zip(counts, cache_lens, firsts)):
        tokens[b, :n] = new_tokens[b].cpu()
        rows[b, :n] = torch.arange(start + first, start + first + n)
        tree_parents = parents[b] if parents is not None else None
        if tree_parents is None:
            positions[b, :n] = torch.arange(start + first, start + first + n)
            tree[b, :n, : first + n] = torch.ones(first + n, first + n, dtype=torch.bool).tril()[first:]
            node_pos[b, : first + n] = torch.arange(start, start + first + n)
        else:
            tree_parents = tree_parents.cpu()
            node_depths = depths(tree_parents)
            positions[b, :n] = start + node_depths[first : first + n]
            tree[b, :n, : first + n] = ancestor_mask(tree_parents)[first : first + n, : first + n]
            node_pos[b, : first + n] = start + node_depths[: first + n]
    kv_len = max(start + f + n for start, f, n in zip(cache_lens, firsts, counts))
    simple = B == 1 and (parents is None or parents[0] is None) and firsts[0] == 0
    attn_mask = None if (simple and (T == 1 or cache_lens[0] == 0)) else _mask(cache_lens, tree, kv_len)
    if window is not None:
        shift = torch.tensor(shifts, dtype=torch.long).view(B, 1)
        real = torch.arange(T).view(1, T) < torch.tensor(counts).view(B, 1)
        positions = torch.where(real, positions + shift, positions)
        if attn_mask is None:
            attn_mask = _mask(cache_lens, tree, kv_len)
        attn_mask = _windowed(attn_mask, cache_lens, node_pos, shifts, positions, real, window)
    key_pos = key_positions(cache_lens, node_pos, shifts or [0] * B, window[0] if window else kv_len, kv_len)
    logits_flat = None
    if logits == "all":
        logits_rows = None
    elif logits == "real":
        logits_rows = None
        logits_flat = torch.cat([torch.arange(n) + b * T for b, n in enumerate(counts)])
    elif logits == "last":
        logits_rows = torch.tensor([[n - 1] for n in counts])
    elif logits == "none":
        logits_rows = torch.zeros(B, 0, dtype=torch.long)
    else:
        width = max(len(r) for r in logits)
        logits_rows = torch.tensor([list(r) + [r[-1] if r else 0] * (width - len(r)) for r in logits])
    first_slot, span_size = min(slot_ids), max(slot_ids) - min(slot_ids) + 1
    in_order = list(slot_ids) == list(range(first_slot, first_slot + B))
    place = None if in_order else torch.tensor(slot_ids, dtype=torch.long) - first_slot
    if place is not None and len(set(slot_ids)) != B:
        raise ValueError(f"slot_ids must be distinct, got {list(slot_ids)}")
    to = lambda x: x.to(device, non_blocking=True)  # noqa: E731
    return ForwardBatch(
        slot_ids=list(slot_ids),
        tokens=to(tokens),
        positions=to(positions),
        rows=to(rows),
        attn_mask=None if attn_mask is None else to(attn_mask),
        kv_len=kv_len,
        logits_rows=None if logits_rows is None else to(logits_rows),
        hidden_layers=tuple(hidden_layers),
        span_first=first_slot,
        span_size=span_size,
        span_place=None if place is None else to(place),
        logits_flat=None if logits_flat is None else to(logits_flat),
        key_pos=to(key_pos),
        starts=tuple(cache_lens),
        ends=tuple(start + f + n for start, f, n in zip(cache_lens, firsts, counts)),
        committed_run=not any(firsts) and (parents is None or all(p is None for p in parents)),
    )


def with_embeds(batch: ForwardBatch, parts: list[tuple[int, int, object]]) -> ForwardBatch:
    """`batch` with the rows of a prompt's own embeddings that fall in its new tokens: parts[b] is
    (the cache length batch row b starts at, its count of new tokens, its request's
    `prompt_embeds`: positions long [K] and rows [K, E], or None). A prompt's positions are its
    cache rows, so row b's token t is position start + t."""
    T = batch.tokens.shape[1]
    at, rows = [], []
    for b, (start, count, embeds) in enumerate(parts):
        if embeds is None:
            continue
        positions, values = embeds
        inside = (positions >= start) & (positions < start + count)  # [K]
        at.append(positions[inside] - start + b * T)
        rows.append(values[inside])
    if not at or sum(len(a) for a in at) == 0:
        return batch
    return replace(batch, embeds=(torch.cat(at).to(batch.tokens.device), torch.cat(rows).to(batch.tokens.device)))


def causal_batch(new_tokens: list[torch.Tensor], hidden_layers: tuple[int, ...] = (), scratch_row: int = -1,
                 device: torch.device | str = "cpu") -> ForwardBatch:
    """`pack(range(B), [0] * B, new_tokens, logits="none", ...)` built on the device with a few
    vectorized ops: every slot starts empty and runs causally (a training batch). The same batch
    field for field (tests/test_layers.py); pack's per-slot loop costs ~0.1 s for 32 x 1024 tokens."""
    B = len(new_tokens)
    lengths = torch.tensor([int(t.shape[0]) for t in new_tokens], device=device)  # [B]
    T = int(lengths.max())
    tokens = torch.nn.utils.rnn.pad_sequence([t.to(device) for t in new_tokens], batch_first=True)  # [B, T]
    cols = torch.arange(T, device=device)  # [T]
    real = cols.view(1, T) < lengths.view(B, 1)  # [B, T]
    rows = torch.where(real, cols.view(1, T), torch.full_like(real, scratch_row, dtype=torch.long))
    positions = torch.where(real, cols.view(1, T), torch.zeros_like(rows))
    mask = None
    if B > 1:  # padded rows see row 0 only (pack's rule); B == 1 is plain causal
        mask = (cols.view(1, 1, T) <= cols.view(1, T, 1)) & real.unsqueeze(-1)  # [B, T, T]
        mask[..., 0] = True
        mask = mask.unsqueeze(1)  # [B, 1, T, T]
    return ForwardBatch(slot_ids=list(range(B)), tokens=tokens, positions=positions, rows=rows, attn_mask=mask,
                        kv_len=T, logits_rows=torch.zeros(B, 0, dtype=torch.long, device=device),
                        hidden_layers=tuple(hidden_layers), span_first=0, span_size=B, starts=(0,) * B,
                        ends=tuple(int(t.shape[0]) for t in new_tokens), committed_run=True)


def _one_chain(slot: int, cache_len: int, tokens: torch.Tensor, tree: bool, logits: str, hidden_layers,
               device) -> ForwardBatch:
    """_pack's batch for one slot whose new tokens run causally (no tree, or a chain: a decode step,
    a chain's verify, a prompt), field for field, without the per-node tree machinery (~1 ms a
    step on a 2-core CPU: docs/benchmarks/2026-11-30-intel-xeon-avx512-amx.md, Quick preset, earlier
    runs): token i sees every cached row and the new tokens up to itself. The mask
    is _pack's too: none for a causal run that starts the cache or is one token, else [1, 1, T, L]."""
    T = int(tokens.shape[0])
    L = cache_len + T
    at = torch.arange(cache_len, L).view(1, T)  # [1, T] positions and cache rows
    mask = None
    if tree or (T > 1 and cache_len > 0):
        mask = torch.ones(T, L, dtype=torch.bool).tril(cache_len).view(1, 1, T, L)  # [1, 1, T, L]
    logits_rows = logits_flat = None
    if logits == "real":
        logits_flat = torch.arange(T)
    elif logits == "last":
        logits_rows = torch.tensor([[T - 1]])
    elif logits == "none":
        logits_rows = torch.zeros(1, 0, dtype=torch.long)
    elif logits != "all":
        raise ValueError(f"logits must be all, real, last, none or rows per slot, got {logits!r}")
    to = lambda x: None if x is None else x.to(device, non_blocking=True)  # noqa: E731
    return ForwardBatch(
        slot_ids=[slot], tokens=to(tokens.reshape(1, T).cpu()), positions=to(at), rows=to(at.clone()),
        attn_mask=to(mask), kv_len=L, logits_rows=to(logits_rows), hidden_layers=tuple(hidden_layers),
        span_first=slot, span_size=1, span_place=None, logits_flat=to(logits_flat), starts=(cache_len,), ends=(L,),
        committed_run=not tree,
    )


def key_positions(cache_lens: list[int], node_pos: torch.Tensor, shifts: list[int], sink: int,
                  kv_len: int) -> torch.Tensor:
    """The position of every cache row a forward reads: [B, kv_len] long. Committed row r holds
    position r (r < sink) or r + shift; row cache_len + i holds tree node i (node_pos[b, i] + shift)."""
    B, width = node_pos.shape
    cols = torch.arange(kv_len).view(1, kv_len)
    lens = torch.tensor(cache_lens).view(B, 1)
    shift = torch.tensor(shifts, dtype=torch.long).view(B, 1)
    committed = torch.where(cols < sink, cols, cols + shift)
    rel = (cols - lens).clamp(0, max(width - 1, 0))
    nodes = torch.gather(node_pos, 1, rel) + shift if width else committed
    return torch.where(cols < lens, committed, nodes)


def _windowed(mask: torch.Tensor, cache_lens, node_pos, shifts, positions, real, window) -> torch.Tensor:
    """mask [B, 1, T, L] and'ed with the window: query at p sees keys at positions < S or > p - W.
    A padded row keeps row 0 (as _mask leaves it)."""
    sink, width = window
    B, _, T, L = mask.shape
    keys = key_positions(cache_lens, node_pos, shifts, sink, L).view(B, 1, 1, L)
    queries = positions.view(B, 1, T, 1)
    mask = mask & ((keys < sink) | (keys > queries - width))
    mask[..., 0] |= ~mask.any(-1)  # padded rows, and nothing else: a real row always sees itself
    return mask


def _mask(cache_lens: list[int], tree: torch.Tensor, kv_len: int) -> torch.Tensor:
    """cache_lens: B ints, tree: [B, T, W] bool (new token x tree node) -> [B, 1, T, kv_len] bool."""
    B, T, W = tree.shape
    lens = torch.tensor(cache_lens).view(B, 1)  # [B, 1]
    cols = torch.arange(kv_len).view(1, kv_len)  # [1, kv_len]
    prefix = (cols < lens).unsqueeze(1).expand(B, T, kv_len)  # committed rows: everyone sees them
    rel = cols - lens  # [B, kv_len]: index among this round's new tokens
    in_new = (rel >= 0) & (rel < W)
    idx = rel.clamp(0, W - 1).unsqueeze(1).expand(B, T, kv_len)
    new = torch.gather(tree, 2, idx) & in_new.unsqueeze(1)
    mask = prefix | new
    # A padded row sees nothing; let it see row 0 so its (unused) output stays finite.
    mask[..., 0] |= ~mask.any(-1)
    return mask.unsqueeze(1)
