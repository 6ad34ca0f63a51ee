"""The MTP head as a trainable module (`outrider train mtp`), unrolled over its own draft steps.

Shapes: B sequences of T tokens, H the target's hidden size, V its vocabulary (the head reads out
through the target's frozen lm_head and embeds with its frozen embedding), nh / G query /
key-value heads of size D. Row p of step s stands for the draft s steps past anchor p:

    step 0   hidden f_p = the target's last-layer output at p    token x_{p+1}   RoPE position p
    step s   hidden = step s-1's output at row p                 token x_{p+s+1} RoPE position p+s
    label    softmax(the target's logits at position p+s+1): predicts x_{p+s+2}

Step s of row p attends to step 0's keys 0..p and to its own row in steps 1..s, which is what the
drafter's chain mask gives (drafters/eagle3.py runs the MTP head too). The loss of step s is
weighted decay**s (FastMTP weights step k by 0.6^(k-1): `--decay 0.6`). The soft cross-entropy
and per-step counts are EAGLE-3's training-time test (`ttt`), shared.
"""

from __future__ import annotations

import math
import torch
import torch.nn.functional as F

from ..eagle3.trainable import Eagle3Job, Eagle3Trainable
from .format import tensor_names
from .head import MtpConfig


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x.float(), weight.shape, weight.float(), eps)


def _turn(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class MtpTrainable(torch.nn.Module):
    """Trainable weights of one MTP module; the target's embedding and lm_head are frozen buffers."""

    ttt = Eagle3Trainable.ttt  # the soft cross-entropy over the unrolled steps (it calls self.unroll)

    def __init__(self, config: MtpConfig, embed: torch.Tensor, lm_head: torch.Tensor, norm: torch.Tensor,
                 *, seed: int = 0):
        super().__init__()
        c = config
        self.config = c
        H, nh, G, D, I = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
        gen = torch.Generator().manual_seed(seed)

        def weight(rows: int, cols: int, std: float = 0.02) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.randn(rows, cols, generator=gen) * std)

        self.eh_proj = weight(H, 2 * H)
        self.q_proj, self.k_proj, self.v_proj = weight(nh * D, H), weight(G * D, H), weight(G * D, H)
        self.o_proj = weight(H, nh * D)
        self.gate_proj, self.up_proj, self.down_proj = weight(I, H), weight(I, H), weight(H, I)
        ones = lambda: torch.nn.Parameter(torch.ones(H))  # noqa: E731
        self.enorm, self.hnorm, self.input_norm, self.post_norm = ones(), ones(), ones(), ones()
        self.norm = torch.nn.Parameter(norm.detach().float().clone())  # shared_head.norm from the target's
        self.register_buffer("embed", embed.detach(), persistent=False)  # [V, H] frozen
        self.register_buffer("lm_head", lm_head.detach(), persistent=False)  # [V, H] frozen
        self.register_buffer("inv_freq", 1.0 / (c.rope_theta ** (torch.arange(0, D, 2).float() / D)),
                             persistent=False)

    @classmethod
    def for_target(cls, target, *, seed: int, used: torch.Tensor | None = None) -> "MtpTrainable":
        """A module sized like `target`; `used` [Vd] (sorted target ids): the rows of the target's
        lm_head the training loss reads out over (a CPU saving: the runtime head reads out over the
        whole vocabulary, which this leaves unchanged: the lm_head is not trained)."""
        t = target.config
        if not isinstance(target.lm_head, torch.Tensor) or not isinstance(target.embed, torch.Tensor):
            raise ValueError("train against a float target (--dtype float32 or bfloat16), not quantized weights")
        config = MtpConfig(hidden_size=t.hidden_size, vocab_size=t.vocab_size, num_heads=t.num_heads,
                           num_kv_heads=t.num_kv_heads, head_dim=t.head_dim, intermediate_size=t.intermediate_size,
                           rms_norm_eps=t.rms_norm_eps, rope_theta=t.rope_theta, num_target_layers=t.num_layers)
        readout = target.lm_head.float() if used is None else target.lm_head.float()[used.to(target.lm_head.device)]
        return cls(config, target.embed.float(), readout, target.norm, seed=seed)

    def taps(self, num_target_layers: int) -> tuple[int, ...]:
        return self.config.taps(num_target_layers)

    def calibrate(self, features, valid=None, keep_function: bool = False) -> None:
        """Nothing to calibrate: the hidden state enters through hnorm."""

    def unroll(self, features: torch.Tensor, tokens: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """features [B, T, 1, H], tokens [B, T] -> per step s, logits [B, T, Vd] of row p (x_{p+s+2})
        over the readout rows (the whole vocabulary unless trained over a subset)."""
        c = self.config
        B, T = tokens.shape
        nh, G, D, eps = c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps
        padded = F.pad(tokens, (0, steps))  # [B, T + steps]
        rows = torch.arange(T, device=tokens.device)
        causal = rows.unsqueeze(1) >= rows.unsqueeze(0)  # [T, T]
        hidden = features[:, :, 0].to(self.eh_proj.dtype)  # [B, T, H]
        keys, values, out = [], [], []
        scale = 1.0 / math.sqrt(D)
        for s in range(steps):
            positions = (rows + s).expand(B, T)
            emb = F.embedding(padded[:, s + 1: s + 1 + T], self.embed).to(hidden.dtype)  # token x_{p+s+1}
            emb = emb * (positions != 0).unsqueeze(-1).to(emb.dtype)
            x0 = F.linear(torch.cat((_norm(emb, self.enorm, eps), _norm(hidden, self.hnorm, eps)), dim=-1),
                          self.eh_proj)  # [B, T, H]
            x = _norm(x0, self.input_norm, eps)
            freqs = positions.unsqueeze(-1).float() * self.inv_freq
            angle = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)  # [B, 1, T, D]
            cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
            q = _turn(F.linear(x, self.q_proj).view(B, T, nh, D).transpose(1, 2), cos, sin)  # [B, nh, T, D]
            k = _turn(F.linear(x, self.k_proj).view(B, T, G, D).transpose(1, 2), cos, sin)  # [B, G, T, D]
            v = F.linear(x, self.v_proj).view(B, T, G, D).transpose(1, 2)
            keys.append(k.repeat_interleave(nh // G, dim=1))  # [B, nh, T, D]
            values.append(v.repeat_interleave(nh // G, dim=1))
            first = ((q @ keys[0].transpose(-1, -2)) * scale).masked_fill(~causal, float("-inf"))  # [B, nh, T, T]
            own = [(q * kj).sum(-1, keepdim=True) * scale for kj in keys[1:]]  # s x [B, nh, T, 1]
            weights = torch.softmax(torch.cat([first, *own], dim=-1), dim=-1)
            attn = weights[..., :T] @ values[0]
            for j, vj in enumerate(values[1:]):
                attn = attn + weights[..., T + j: T + j + 1] * vj
            h = x0 + F.linear(attn.transpose(1, 2).reshape(B, T, nh * D), self.o_proj)
            m = _norm(h, self.post_norm, eps)
            h = h + F.linear(F.silu(F.linear(m, self.gate_proj)) * F.linear(m, self.up_proj), self.down_proj)
            out.append(F.linear(_norm(h, self.norm, eps), self.lm_head))  # [B, T, V]
            hidden = h
        return out

    # -- weights on disk (heads/mtp/format.py) ---------------------------------------------------------
    _ATTRS = ("enorm", "hnorm", "eh_proj", "norm", "input_norm", "q_proj", "k_proj", "v_proj", "o_proj",
              "post_norm", "gate_proj", "up_proj", "down_proj")

    def _names(self) -> dict[str, str]:
        return dict(zip(self._ATTRS, tensor_names(self.config.num_target_layers)))

    def state_tensors(self, training: bool = False) -> dict[str, torch.Tensor]:
        return {disk: getattr(self, attr).detach().clone().contiguous() for attr, disk in self._names().items()}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        names = self._names()
        missing = [disk for disk in names.values() if disk not in tensors]
        if missing:
            raise ValueError(f"head tensors lack {', '.join(missing)}")
        with torch.no_grad():
            for attr, disk in names.items():
                getattr(self, attr).copy_(tensors[disk])

    def export_config(self, **extra) -> dict:
        from .format import config_json

        return {**config_json(self.config), **extra}


def job(o, target, tokenizer, used: torch.Tensor, layer_ids=None) -> Eagle3Job:
    """The job of run options `o` (train/options.py): EAGLE-3's (the unrolled steps weighted
    decay**s) over this module, the loss read out over the target ids `used` (--draft-vocab)."""
    every = used.numel() == target.config.vocab_size
    return Eagle3Job(MtpTrainable.for_target(target, seed=o.seed, used=None if every else used), o.ttt_steps, o.decay)
