"""The MTP head: DeepSeek-V3's multi-token-prediction module, one decoder layer over [embedding ; target hidden].

Shapes: H the target's hidden size (the head's: it shares the target's embedding and lm_head),
V the vocabulary, T rows. One head row p reads the target's last hidden state at position p and
the token of position p + 1, and predicts the token of position p + 2 (vLLM's `deepseek_mtp.py`,
llama.cpp's draft-mtp; the same alignment as EAGLE):

    f_p     = hidden of position p: the output of the target's last layer, before its final norm
              (llama.cpp's `t_h_nextn`, "the hidden state before the final output norm");
              while drafting, the head's own output hidden of the parent row stands in for it
    e       = embed(token p+1), zeroed at position 0 (vLLM: "masking inputs at position 0")
    x0      = eh_proj(cat(enorm(e), hnorm(f_p)))             # [2H] -> [H]
    h       = x0 + o_proj(attention(rope(q, k), v))          # q, k, v from input_layernorm(x0)
    h       = h + mlp(post_attention_layernorm(h))           # the output hidden: the next row's f
    logits  = lm_head(shared_head.norm(h))                   # [V], the target's lm_head

One module reused autoregressively for every draft step (vLLM with num_nextn_predict_layers 1).
`MtpHead.forward` is the fast path (slots, K/V cache, tree masks from models/batch.py), with the
interface drafters/eagle3.py's drafter drives (fuse, forward, greedy_token, target_ids,
target_logits); heads/mtp/reference.py is the slow one it is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...models.batch import ForwardBatch
from ...models.kv_cache import KVCache
from ...models.layers import apply_rotary, embedding, linear, rms_norm, rotary_tables
from ..layer import attend_and_mlp


@dataclass(frozen=True)
class MtpConfig:
    hidden_size: int  # H (= the target's)
    vocab_size: int  # V
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    num_target_layers: int  # N: the head is stored as layer N (model.layers.{N}.*)

    def taps(self, num_target_layers: int) -> tuple[int, ...]:
        """The one target hidden state it reads, in our tap convention (heads/taps.py): the output
        of the last layer, N."""
        return (num_target_layers,)


@dataclass
class MtpWeights:
    enorm: torch.Tensor  # [H]
    hnorm: torch.Tensor  # [H]
    eh_proj: torch.Tensor  # [H, 2H]: columns of the normed embedding, then of the normed hidden
    input_norm: torch.Tensor  # [H]
    qkv: torch.Tensor  # [(nh + 2 nkv) * d, H]: q, k, v rows
    o: torch.Tensor  # [H, nh * d]
    post_norm: torch.Tensor  # [H]
    gate_up: torch.Tensor  # [2I, H]
    down: torch.Tensor  # [H, I]
    norm: torch.Tensor  # [H] shared_head.norm
    lm_head: object  # [V, H]: the target's (shared; possibly a QuantLinear)
    embed: object  # [V, H]: the target's (shared)
    draft_to_target: None = None  # the whole vocabulary: draft id == target id


class MtpHead:
    def __init__(self, config: MtpConfig, weights: MtpWeights):
        self.config = config
        self.w = weights
        c = config
        self.inv_freq = 1.0 / (c.rope_theta ** (
            torch.arange(0, c.head_dim, 2, dtype=torch.float32, device=weights.norm.device) / c.head_dim))

    @property
    def device(self) -> torch.device:
        return self.w.norm.device

    @property
    def dtype(self) -> torch.dtype:
        return self.w.norm.dtype

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        c = self.config
        return KVCache(1, num_slots, max_len, c.num_kv_heads, c.head_dim, self.dtype, self.device)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """features: [..., 1, H] (the target's last layer output) -> [..., H] as they are."""
        return features[..., 0, :].to(self.dtype)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: KVCache, hidden: torch.Tensor, last: torch.Tensor | None = None):
        """batch: rows' tokens (token p+1 for row p), positions, cache rows, mask; hidden [B, T, H]
        their input hidden. Writes the rows' K/V; returns (logits [B, T, V] float32, output hidden
        [B, T, H]), or with `last` ([B] long) only each slot's row `last` ([B, 1, V], [B, 1, H])."""
        if batch.span_place is not None:
            raise ValueError("MtpHead.forward takes slots in order (span_place None)")
        c, w = self.config, self.w
        B, T = batch.tokens.shape
        nh, G, D, eps = c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps
        emb = embedding(batch.tokens, w.embed).to(self.dtype)  # [B, T, H]
        emb = emb * (batch.positions != 0).unsqueeze(-1).to(self.dtype)  # position 0: zero (vLLM's)
        x0 = linear(torch.cat((rms_norm(emb, w.enorm, eps), rms_norm(hidden.to(self.dtype), w.hnorm, eps)), dim=-1),
                    w.eh_proj)  # [B, T, H]
        x = rms_norm(x0, w.input_norm, eps)
        cos, sin = rotary_tables(batch.positions, self.inv_freq, self.dtype)
        q, k, v = linear(x, w.qkv).split((nh * D, G * D, G * D), dim=-1)
        q = apply_rotary(q.view(B, T, nh, D).transpose(1, 2), cos, sin)  # [B, nh, T, D]
        k = apply_rotary(k.view(B, T, G, D).transpose(1, 2), cos, sin).transpose(1, 2)  # [B, T, G, D]
        cache.write(0, batch.slots, batch.rows, k, v.view(B, T, G, D))
        keys, values = cache.span(0, batch.span_first, batch.span_size, batch.kv_len)  # [B, G, L, D]
        h = attend_and_mlp(x0, q, keys, values, batch.attn_mask, w.o, w.post_norm, w.gate_up, w.down, eps)
        if last is not None:
            h = h[torch.arange(B, device=h.device), last.to(h.device)].unsqueeze(1)  # [B, 1, H]
        return linear(rms_norm(h, w.norm, eps), w.lm_head).float(), h

    # -- the vocabulary: the target's whole one ---------------------------------------------------
    def greedy_token(self, logits: torch.Tensor) -> int:
        return int(logits.argmax())

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids

    def target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits
