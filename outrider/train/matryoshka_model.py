"""The trainable Matryoshka suite (models/matryoshka.py's nesting) and its joint loss.

`NestedLM` holds one Llama-shaped weight set (multi-head attention, SwiGLU, RMS norms, RoPE, a
tied embedding) in Hugging Face's tensor names and runs any slice of it: the first L_s layers,
heads 0..h_s-1, FFN neurons 0..f_s-1 (models/matryoshka.py). The engine loads what `save` writes
as a plain Llama folder (the largest) and cuts the slices from it (`slice_decoder`); tests check
the two agree.

The joint loss of one batch (the Matryoshka LM suite's, as docs/methods.md#matryoshka reads it):

    L = sum_s w_s CE_s  +  kd * sum_{s < S} T^2 KL(p_S^T || p_s^T)

CE_s the next-token cross-entropy of slice s over the labelled positions, p_S the largest slice's
distribution (detached: the teacher is not pulled toward its students), T the distillation
temperature. Independent baselines are NestedLMs of one slice each, kd 0.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..models.matryoshka import Slice


class NestedLM(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int, heads: int, head_dim: int, ffn: int,
                 rope_theta: float = 10000.0, eps: float = 1e-5, seed: int = 0):
        super().__init__()
        self.vocab, self.hidden, self.heads, self.head_dim, self.ffn = vocab, hidden, heads, head_dim, ffn
        self.num_layers, self.rope_theta, self.eps = layers, rope_theta, eps
        g = torch.Generator().manual_seed(seed)
        normal = lambda *shape, std=0.02: nn.Parameter(torch.randn(*shape, generator=g) * std)  # noqa: E731
        self.embed = normal(vocab, hidden)  # [V, E], tied to the head
        out_std = 0.02 / math.sqrt(2 * layers)  # residual branches' outputs scaled down (GPT-2's)
        self.blocks = nn.ModuleList()
        for _ in range(layers):
            b = nn.Module()
            b.input_norm = nn.Parameter(torch.ones(hidden))
            b.q, b.k, b.v = normal(heads * head_dim, hidden), normal(heads * head_dim, hidden), normal(heads * head_dim, hidden)
            b.o = normal(hidden, heads * head_dim, std=out_std)  # [E, H D]
            b.post_norm = nn.Parameter(torch.ones(hidden))
            b.gate, b.up = normal(ffn, hidden), normal(ffn, hidden)  # [I, E]
            b.down = normal(hidden, ffn, std=out_std)  # [E, I]
            self.blocks.append(b)
        self.norm = nn.Parameter(torch.ones(hidden))

    @property
    def largest(self) -> Slice:
        return Slice(self.num_layers, self.heads, self.ffn)

    def forward(self, tokens: torch.Tensor, s: Slice | None = None) -> torch.Tensor:
        """tokens [B, T] long -> logits [B, T, V] float32 of slice s (default: the whole model), causal."""
        s = s or self.largest
        B, T = tokens.shape
        D, h, f = self.head_dim, s.heads, s.ffn
        inv = 1.0 / self.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D)  # [D/2]
        freqs = torch.arange(T, dtype=torch.float32)[:, None] * inv  # [T, D/2]
        emb = torch.cat((freqs, freqs), -1)  # [T, D]
        cos, sin = emb.cos(), emb.sin()
        x = self.embed[tokens]  # [B, T, E]
        for b in self.blocks[: s.layers]:
            a = F.rms_norm(x, (self.hidden,), b.input_norm, self.eps)
            q = (a @ b.q[: h * D].T).view(B, T, h, D).transpose(1, 2)  # [B, h, T, D]
            k = (a @ b.k[: h * D].T).view(B, T, h, D).transpose(1, 2)
            v = (a @ b.v[: h * D].T).view(B, T, h, D).transpose(1, 2)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, h, T, D]
            x = x + att.transpose(1, 2).reshape(B, T, h * D) @ b.o[:, : h * D].T
            m = F.rms_norm(x, (self.hidden,), b.post_norm, self.eps)
            x = x + (F.silu(m @ b.gate[:f].T) * (m @ b.up[:f].T)) @ b.down[:, :f].T
        return F.rms_norm(x, (self.hidden,), self.norm, self.eps) @ self.embed.T  # [B, T, V]

    # -- the Hugging Face Llama folder -------------------------------------------------------------
    def state(self) -> dict[str, torch.Tensor]:
        """The weights under LlamaForCausalLM's names (tied: no lm_head.weight)."""
        out = {"model.embed_tokens.weight": self.embed, "model.norm.weight": self.norm}
        for i, b in enumerate(self.blocks):
            p = f"model.layers.{i}."
            out.update({p + "input_layernorm.weight": b.input_norm, p + "post_attention_layernorm.weight": b.post_norm,
                        p + "self_attn.q_proj.weight": b.q, p + "self_attn.k_proj.weight": b.k,
                        p + "self_attn.v_proj.weight": b.v, p + "self_attn.o_proj.weight": b.o,
                        p + "mlp.gate_proj.weight": b.gate, p + "mlp.up_proj.weight": b.up,
                        p + "mlp.down_proj.weight": b.down})
        return {k: v.detach().contiguous().clone() for k, v in out.items()}

    def config(self, slices: list[Slice] | None = None, extra: dict | None = None) -> dict:
        """config.json of the whole model (a suite's lists its slices)."""
        raw = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": self.vocab,
               "hidden_size": self.hidden, "intermediate_size": self.ffn, "num_hidden_layers": self.num_layers,
               "num_attention_heads": self.heads, "num_key_value_heads": self.heads, "head_dim": self.head_dim,
               "hidden_act": "silu", "rms_norm_eps": self.eps, "rope_theta": self.rope_theta,
               "max_position_embeddings": 4096, "tie_word_embeddings": True, "attention_bias": False,
               "mlp_bias": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}
        if slices:
            raw["matryoshka"] = {"slices": [s.to_json() for s in slices]}
        return {**raw, **(extra or {})}

    def save(self, folder: Path, slices: list[Slice] | None = None, extra: dict | None = None) -> None:
        from safetensors.torch import save_file

        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(self.config(slices, extra), indent=1) + "\n")
        save_file(self.state(), str(folder / "model.safetensors"), metadata={"format": "pt"})


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, h, T, D] rotated by position (half-split layout, as models/layers.apply_rotary)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


def joint_loss(model: NestedLM, tokens: torch.Tensor, mask: torch.Tensor, slices: list[Slice],
               weights: list[float], kd: float, temperature: float = 1.0) -> tuple[torch.Tensor, dict]:
    """tokens [B, T] long, mask [B, T] bool (True: token t is a label, predicted from t-1) -> (the
    loss L above, its terms: ce[s], kl[s] as floats, the largest's kl absent). slices smallest first."""
    labels = tokens[:, 1:]  # [B, T-1]
    keep = mask[:, 1:]  # [B, T-1]
    n = keep.sum().clamp(min=1)
    logits = [model(tokens[:, :-1], s) for s in slices]  # each [B, T-1, V]
    total = tokens.new_zeros((), dtype=torch.float32)
    terms = {"ce": [], "kl": []}
    for lg, w in zip(logits, weights):
        ce = (F.cross_entropy(lg.flatten(0, 1), labels.flatten(), reduction="none") * keep.flatten()).sum() / n
        total = total + w * ce
        terms["ce"].append(float(ce.detach()))
    if kd:
        teacher = F.log_softmax(logits[-1].detach() / temperature, -1)  # [B, T-1, V]
        for lg in logits[:-1]:
            student = F.log_softmax(lg / temperature, -1)
            kl = ((teacher.exp() * (teacher - student)).sum(-1) * keep).sum() / n  # KL(p_S || p_s) per position
            total = total + kd * temperature ** 2 * kl
            terms["kl"].append(float(kl.detach()))
    return total, terms
