"""The EAGLE-3 head: fused target features + one decoder layer over [embedding ; hidden].

Shapes: Ht the target's hidden size, H the head's, V the target vocabulary, Vd the draft
vocabulary (Vd <= V), T rows. One head row p reads the feature of position p and the token of
position p + 1, and predicts the token of position p + 2:

    feature   f_p = fc(cat(t_a[p], t_b[p], t_c[p]))       # [3Ht] -> [H]: three target layers
              (while drafting, the head's own output hidden of the parent row stands in for f_p)
    x         = cat(input_layernorm(embed(token p+1)), hidden_norm(f_p))    # [2H] into q/k/v
    h         = f_p + o_proj(attention(x))       (norm_before_residual: hidden_norm(f_p) + ...)
    h         = h + mlp(post_attention_layernorm(h))      # the output hidden: the next row's input
    logits    = lm_head(norm(h))                          # [Vd]; draft id d is target id d2t_map[d]

The embedding is always the target's unless the head carries its own (`embed_tokens.weight`),
and so is the lm_head unless the head has its own reduced one over Vd draft tokens with the
maps of learned-drafters.md (d2t[d] = target - d, t2d[target] true for the Vd kept tokens):
shared tensors are the target's own objects, never copies. RoPE position of row p is p.

`Eagle3Head.forward` is the fast path (batched slots, K/V cache, tree masks from
models/batch.py); heads/eagle3/reference.py is the slow one it is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...models.kv_cache import KVCache
from ...models.batch import ForwardBatch
from ..layer import attend_and_mlp
from ..taps import taps
from ..vocab_map import to_target_ids, to_target_logits
from ...models.layers import apply_rotary, embedding, linear, rms_norm, rotary_tables


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int  # H
    target_hidden_size: int  # Ht
    vocab_size: int  # V: the target's vocabulary
    draft_vocab_size: int  # Vd
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    norm_before_residual: bool = False
    layer_ids: tuple[int, ...] | None = None  # as stored; None: the default 2, N//2, N-3 (vllm)
    layer_convention: str = "vllm"

    def taps(self, num_target_layers: int) -> tuple[int, ...]:
        """The three target layers in our tap convention (heads/taps.py: the stored ids in
        `layer_convention`; without ids 2, N//2, N-3 as "vllm" counts them)."""
        n = num_target_layers
        ids = self.layer_ids if self.layer_ids is not None else (2, n // 2, n - 3)
        return taps(ids, self.layer_convention)


@dataclass
class Eagle3Weights:
    fc: torch.Tensor  # [H, 3Ht]
    input_norm: torch.Tensor  # [H]
    hidden_norm: torch.Tensor  # [H]
    qkv: torch.Tensor  # [(nh + 2 nkv) * d, 2H]: q, k, v rows
    o: torch.Tensor  # [H, nh * d]
    post_norm: torch.Tensor  # [H]
    gate_up: torch.Tensor  # [2I, H]: gate rows then up rows
    down: torch.Tensor  # [H, I]
    norm: torch.Tensor  # [H]
    lm_head: object  # [Vd, H], or the target's [V, H] (shared; possibly a QuantLinear)
    embed: object  # [V, H]: the target's (shared; possibly quantized blocks) or the head's own
    draft_to_target: torch.Tensor | None  # [Vd] long: target id of draft id d; None: identity


class Eagle3Head:
    def __init__(self, config: Eagle3Config, weights: Eagle3Weights):
        self.config = config
        self.w = weights
        self._native = None  # (QWeight * 4), False (the torch layer), or None: not decided yet
        self._ordered = None  # draft ids in target-id order (greedy_token), decided at first use
        c = config
        self.inv_freq = 1.0 / (c.rope_theta ** (
            torch.arange(0, c.head_dim, 2, dtype=torch.float32, device=weights.norm.device) / c.head_dim))

    @property
    def device(self) -> torch.device:
        return self.w.norm.device  # a float tensor whatever the matrices are kept in

    @property
    def dtype(self) -> torch.dtype:
        return self.w.norm.dtype

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        c = self.config
        return KVCache(1, num_slots, max_len, c.num_kv_heads, c.head_dim, self.dtype, self.device)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """features: [..., 3, Ht] (the three tapped layers, low to high) -> [..., H]."""
        return linear(features.reshape(*features.shape[:-2], -1).to(self.dtype), self.w.fc)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: KVCache, hidden: torch.Tensor, last: torch.Tensor | None = None):
        """batch: the rows' tokens (token p+1 for row p), positions, cache rows and mask
        (models/batch.py; slots in order); hidden: [B, T, H] their input features.
        Writes the rows' K/V; returns (logits [B, T, Vd] float32, output hidden [B, T, H]), or with
        `last` ([B] long: one row per slot) only those rows' ([B, 1, Vd], [B, 1, H]): a catch-up
        over many committed rows needs the output of its last one alone."""
        if batch.span_place is not None:
            raise ValueError("Eagle3Head.forward takes slots in order (span_place None)")
        c, w = self.config, self.w
        B, T = batch.tokens.shape
        nh, G, D = c.num_heads, c.num_kv_heads, c.head_dim
        eps = c.rms_norm_eps
        emb = embedding(batch.tokens, w.embed).to(self.dtype)  # [B, T, H]
        normed = rms_norm(hidden, w.hidden_norm, eps)
        residual = normed if c.norm_before_residual else hidden
        x = torch.cat((rms_norm(emb, w.input_norm, eps), normed), dim=-1)  # [B, T, 2H]
        cos, sin = rotary_tables(batch.positions, self.inv_freq, self.dtype)
        if self._native is None:
            self._native = self._native_matrices()
        if self._native is not False:  # the layer in one native call (kernels/decoder_layer.py)
            from ...kernels.decoder_layer import LayerCall

            call = LayerCall(batch, cache, residual, cos, sin, nh, G, D, c.intermediate_size, h_in=x)
            call.run(0, self._native, None, w.post_norm, eps)
            return self._out(call.x.view(B, T, -1), last)
        q, k, v = linear(x, w.qkv).split((nh * D, G * D, G * D), dim=-1)
        q = apply_rotary(q.view(B, T, nh, D).transpose(1, 2), cos, sin)  # [B, nh, T, D]
        k = apply_rotary(k.view(B, T, G, D).transpose(1, 2), cos, sin).transpose(1, 2)  # [B, T, G, D]
        cache.write(0, batch.slots, batch.rows, k, v.view(B, T, G, D))
        keys, values = cache.span(0, batch.span_first, batch.span_size, batch.kv_len)  # [B, G, L, D]
        h = attend_and_mlp(residual, q, keys, values, batch.attn_mask, w.o, w.post_norm, w.gate_up, w.down, eps)
        return self._out(h, last)  # h: [B, T, H]

    def _out(self, h: torch.Tensor, last: torch.Tensor | None):
        """h: [B, T, H] the layer's output -> (logits [B, T', Vd] float32, h [B, T', H]); T' = T, or
        1 with `last` (the row of each slot to keep)."""
        if last is not None:
            h = h[torch.arange(h.shape[0], device=h.device), last.to(h.device)].unsqueeze(1)  # [B, 1, H]
        return linear(rms_norm(h, self.w.norm, self.config.rms_norm_eps), self.w.lm_head).float(), h

    def _native_matrices(self):
        """(QWeight * 4) when the head's matrices are native QuantLinears on a float32 CPU head
        (`eagle3:PATH@q4_0`, the default beside a quantized target), else False: the torch layer."""
        from ...kernels.decoder_layer import NativeLayers, enabled

        if self.device.type != "cpu" or self.dtype != torch.float32 or not enabled():
            return False
        found = NativeLayers.matrices([self.w.qkv, self.w.o, self.w.gate_up, self.w.down])
        return False if found is None else found

    def greedy_token(self, logits: torch.Tensor) -> int:
        """The target id of the largest of draft logits [Vd]: what argmax over target_logits gives
        (its first maximum), without the [V] tensor when draft ids are in target-id order."""
        m = self.w.draft_to_target
        if m is None:
            return int(logits.argmax())
        if self._ordered is None:
            self._ordered = bool((m[1:] > m[:-1]).all())
        return int(m[logits.argmax()]) if self._ordered else int(self.target_logits(logits).argmax())

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target ids (same shape)."""
        return to_target_ids(self.w.draft_to_target, draft_ids)

    def target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., Vd] -> [..., V]: the draft logits at their target ids, -inf elsewhere."""
        return to_target_logits(self.w.draft_to_target, logits, self.config.vocab_size)
