"""The DFlash head: a block drafter that proposes a whole block of tokens in one forward.

Shapes: Ht the target's hidden size, H the head's (= the target's: it shares the target's
embedding and output head), n taps (target layers read), L draft layers, B the block size,
V the target vocabulary, Vd the draft vocabulary (Vd <= V). Positions count from 0.

With n committed tokens x_0..x_{n-1}, the root x_{n-1} (position n-1) is the block's first slot
and the other B-1 slots hold MASK (a token id of the target's vocabulary, `mask_token_id`):

    context   c_p = hidden_norm(fc(cat(taps of position p)))      [n taps * Ht] -> [H], p < n-1
    block     h   = embed([x_{n-1}, MASK, ..., MASK])              [B, H] at positions n-1 .. n+B-2
    each layer l (pre-norm, Qwen3-style attention with q_norm/k_norm per head):
              x   = input_norm(h)
              q   = q_norm(q_proj(x))                              queries: the block's B rows only
              k   = k_norm(k_proj(cat(c, x)));  v = v_proj(cat(c, x))   the context is injected as
                                                 extra keys/values in every layer (no norm of its own)
              h   = h + o_proj(attention(rope(q), rope(k), v))      NOT causal: the block sees all
                                                 the context and the whole block, both ways
              h   = h + mlp(post_norm(h))
    logits    = lm_head(norm(h[1:]))                               [B-1, Vd]: slot k (1..B-1)
                                                 predicts x at position n-1+k

The context K/V of every layer depends only on the context rows (not on the block), so it is
written once per committed position into the head's K/V cache and follows the committed prefix
across rounds (a rejection drops nothing: context rows are committed positions only; the block's
own K/V is never cached). This is DFlash's layout (z-lab/dflash `dflash/model.py`, read at
44947fb): `fc`, `hidden_norm`, `layers.{l}.self_attn.{q,k,v,o}_proj`, `q_norm`, `k_norm`,
`input_layernorm`, `post_attention_layernorm`, `mlp.{gate,up,down}_proj`, `norm`.

`DFlashHead.block` is the fast path (slots, cached context); heads/dflash/reference.py is the
slow one it is tested against (the whole context recomputed, one sequence, nothing cached).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...models.kv_cache import KVCache
from ..layer import attend_and_mlp
from ..taps import taps
from ..vocab_map import to_target_ids, to_target_logits
from ...models.layers import apply_rotary, embedding, linear, rms_norm, rotary_tables


def default_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """DFlash's default taps (its own convention: id l = the output of layer l, 0-based): one per
    draft layer, spread evenly over layers 1 .. N-3; one draft layer reads the middle layer."""
    n, k = num_target_layers, num_draft_layers
    if k == 1:
        return (n // 2,)
    return tuple(int(round(1 + i * (n - 4) / (k - 1))) for i in range(k))


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int  # H (= the target's)
    target_hidden_size: int  # Ht
    vocab_size: int  # V
    num_layers: int  # L
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    block_size: int  # B: the root and B-1 masked slots
    mask_token_id: int
    target_layer_ids: tuple[int, ...] | None = None  # DFlash's convention; None: default_layer_ids
    draft_vocab_size: int | None = None  # Vd; None: V (the target's lm_head)
    num_target_layers: int | None = None  # N of the target it was made for (z-lab's config records it)

    def layer_ids(self, num_target_layers: int) -> tuple[int, ...]:
        ids = self.target_layer_ids
        return tuple(ids) if ids is not None else default_layer_ids(num_target_layers, self.num_layers)

    def taps(self, num_target_layers: int) -> tuple[int, ...]:
        """The target layers in our tap convention (heads/taps.py): DFlash's ids count layer
        outputs, 0-based (the "sglang" convention), so id l is our l + 1."""
        return taps(self.layer_ids(num_target_layers), "sglang")


@dataclass
class DFlashLayer:
    input_norm: torch.Tensor  # [H]
    q: object  # [nh * d, H]
    k: object  # [nkv * d, H]
    v: object  # [nkv * d, H]
    q_norm: torch.Tensor  # [d]
    k_norm: torch.Tensor  # [d]
    o: object  # [H, nh * d]
    post_norm: torch.Tensor  # [H]
    gate_up: object  # [2I, H]: gate rows then up rows
    down: object  # [H, I]


@dataclass
class DFlashWeights:
    fc: object  # [H, n * Ht]
    hidden_norm: torch.Tensor  # [H]
    layers: list[DFlashLayer]
    norm: torch.Tensor  # [H]
    lm_head: object  # [Vd, H] the head's own, or the target's [V, H] (shared, possibly quantized)
    embed: object  # [V, H]: the target's (shared)
    draft_to_target: torch.Tensor | None = None  # [Vd] long: target id of draft id d; None: identity


class DFlashHead:
    def __init__(self, config: DFlashConfig, weights: DFlashWeights):
        self.config = config
        self.w = weights
        c = config
        self.inv_freq = 1.0 / (c.rope_theta ** (
            torch.arange(0, c.head_dim, 2, dtype=torch.float32, device=weights.norm.device) / c.head_dim))
        self._ordered = None

    @property
    def device(self) -> torch.device:
        return self.w.norm.device

    @property
    def dtype(self) -> torch.dtype:
        return self.w.norm.dtype

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        c = self.config
        return KVCache(c.num_layers, num_slots, max_len, c.num_kv_heads, c.head_dim, self.dtype, self.device)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """features: [m, n, Ht] (the tapped layers, low to high) -> context rows [m, H]."""
        flat = features.flatten(1).to(self.dtype)  # [m, n * Ht]
        return rms_norm(linear(flat, self.w.fc), self.w.hidden_norm, self.config.rms_norm_eps)

    def _kv(self, layer: DFlashLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x: [S, T, H] (normed block rows or context rows) -> k, v: [S, G, T, D], k rotated."""
        c = self.config
        S, T, _ = x.shape
        k = rms_norm(linear(x, layer.k).view(S, T, c.num_kv_heads, c.head_dim), layer.k_norm, c.rms_norm_eps)
        k = apply_rotary(k.transpose(1, 2), cos, sin)
        v = linear(x, layer.v).view(S, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
        return k, v

    @torch.inference_mode()
    def write_context(self, cache: KVCache, slot: int, start: int, rows: torch.Tensor) -> None:
        """rows: [m, H] context rows of positions start .. start+m-1 (from `fuse`): their K/V in
        every layer, written to cache rows start .. start+m-1 of `slot`. No attention is run: the
        context only offers keys and values."""
        m = rows.shape[0]
        if m == 0:
            return
        positions = torch.arange(start, start + m, device=self.device).unsqueeze(0)  # [1, m]
        cos, sin = rotary_tables(positions, self.inv_freq, self.dtype)
        x = rows.unsqueeze(0)  # [1, m, H]
        for l, layer in enumerate(self.w.layers):
            k, v = self._kv(layer, x, cos, sin)  # [1, G, m, D]
            cache.write_slot(l, slot, start, k[0], v[0])

    @torch.inference_mode()
    def block(self, cache: KVCache, slots: list[int], context: list[int], tokens: torch.Tensor, first: int = 1):
        """One forward for a block per sequence: slots[s]'s first `context[s]` cache rows are its
        context (positions 0 .. context[s]-1); tokens: [S, B] its block (root, MASK...) at
        positions context[s] .. context[s]+B-1. Returns (logits [S, B-first, Vd] float32 of slots
        first..B-1, hidden [S, B, H] the last layer's output before the final norm). first=0 reads
        out the root's slot too (DSpark, heads/dspark/head.py: the anchor is a prediction position)."""
        c, w = self.config, self.w
        S, B = tokens.shape
        nh, D, eps = c.num_heads, c.head_dim, c.rms_norm_eps
        L = max(context)
        start = torch.tensor(context, device=self.device)  # [S]
        positions = start.unsqueeze(1) + torch.arange(B, device=self.device)  # [S, B]
        cos, sin = rotary_tables(positions, self.inv_freq, self.dtype)  # [S, 1, B, D]
        seen = torch.arange(L, device=self.device).unsqueeze(0) < start.unsqueeze(1)  # [S, L]
        mask = torch.cat((seen, seen.new_ones(S, B)), dim=1)[:, None, None, :].expand(S, 1, B, L + B)
        index = torch.tensor(slots, device=self.device)
        h = embedding(tokens.to(self.device), w.embed).to(self.dtype)  # [S, B, H]
        for l, layer in enumerate(w.layers):
            x = rms_norm(h, layer.input_norm, eps)
            q = rms_norm(linear(x, layer.q).view(S, B, nh, D), layer.q_norm, eps)
            q = apply_rotary(q.transpose(1, 2), cos, sin)  # [S, nh, B, D]
            k, v = self._kv(layer, x, cos, sin)  # [S, G, B, D]
            held_k, held_v = cache.gather(l, index, L)  # [S, G, L, D]
            keys = torch.cat((held_k, k), dim=2)  # [S, G, L + B, D]
            values = torch.cat((held_v, v), dim=2)
            h = attend_and_mlp(h, q, keys, values, mask, layer.o, layer.post_norm, layer.gate_up, layer.down, eps)
        logits = linear(rms_norm(h[:, first:], w.norm, eps), w.lm_head).float()  # [S, B-first, Vd]
        return logits, h

    # -- the draft vocabulary (as heads/eagle3/head.py) -----------------------------------------------
    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target ids (same shape)."""
        return to_target_ids(self.w.draft_to_target, draft_ids)

    def target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., Vd] -> [..., V]: the draft logits at their target ids, -inf elsewhere."""
        return to_target_logits(self.w.draft_to_target, logits, self.config.vocab_size)
