"""A Llama decoder's layers as plain batched torch, from its Hugging Face tensors: what hybrid
distillation (train/distill_hybrid.py) runs the teacher and the hybrid-so-far with. Slow-path
float32 and no cache: sequences of one length from position 0. The runtime's Decoder is the model
users run; tests/test_delta_distill.py checks these logits against it.

    t = LlamaLayers(tensors, raw_config)
    hn = t.input_norm(l, x)        # x [B, T, E] the residual stream before layer l
    y = t.attention(l, hn)         # attention's output (after o_proj), [B, T, E]
    x = t.mlp_block(l, x + y)      # the residual stream after layer l
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class LlamaLayers:
    def __init__(self, tensors: dict[str, torch.Tensor], raw: dict):
        self.w = tensors
        self.E = int(raw["hidden_size"])
        self.H = int(raw["num_attention_heads"])
        self.KV = int(raw.get("num_key_value_heads") or self.H)
        self.D = int(raw.get("head_dim") or self.E // self.H)
        self.eps = float(raw.get("rms_norm_eps", 1e-6))
        self.layers = int(raw["num_hidden_layers"])
        theta = float(raw.get("rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0)))
        self.inv_freq = 1.0 / theta ** (torch.arange(0, self.D, 2, dtype=torch.float32) / self.D)  # [D/2]
        self.embed = tensors["model.embed_tokens.weight"]
        self.head = tensors.get("lm_head.weight", self.embed)

    def p(self, layer: int, name: str) -> torch.Tensor:
        return self.w[f"model.layers.{layer}.{name}"]

    def input_norm(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (self.E,), self.p(layer, "input_layernorm.weight"), self.eps)

    def _rope(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, h, T, D] rotated by position (Hugging Face's half-split layout)."""
        T = x.shape[2]
        angles = torch.arange(T, dtype=torch.float32)[:, None] * self.inv_freq[None]  # [T, D/2]
        cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
        a, b = x.chunk(2, -1)
        return x * cos + torch.cat((-b, a), -1) * sin

    def attention(self, layer: int, hn: torch.Tensor) -> torch.Tensor:
        B, T, E = hn.shape
        q = (hn @ self.p(layer, "self_attn.q_proj.weight").T).view(B, T, self.H, self.D).transpose(1, 2)
        k = (hn @ self.p(layer, "self_attn.k_proj.weight").T).view(B, T, self.KV, self.D).transpose(1, 2)
        v = (hn @ self.p(layer, "self_attn.v_proj.weight").T).view(B, T, self.KV, self.D).transpose(1, 2)
        q, k = self._rope(q), self._rope(k)
        rep = self.H // self.KV
        o = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                           is_causal=True)  # [B, H, T, D]
        return o.transpose(1, 2).reshape(B, T, self.H * self.D) @ self.p(layer, "self_attn.o_proj.weight").T

    def mlp_block(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """x: the stream after the mixer -> the stream after the MLP."""
        h = F.rms_norm(x, (self.E,), self.p(layer, "post_attention_layernorm.weight"), self.eps)
        gate = h @ self.p(layer, "mlp.gate_proj.weight").T
        up = h @ self.p(layer, "mlp.up_proj.weight").T
        return x + (F.silu(gate) * up) @ self.p(layer, "mlp.down_proj.weight").T

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (self.E,), self.w["model.norm.weight"], self.eps) @ self.head.T
