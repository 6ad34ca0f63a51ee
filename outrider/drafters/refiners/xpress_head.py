"""xPress's refiner head: block-local and block-global features, a causal low-rank mixer, a logit bias.

Shapes: B the block size (slot 0 the root, slots 1..B-1 drafted), H the block head's hidden size,
r the rank, M = 2r the MLP's width, Vd the block head's readout (draft vocabulary). A block's
hidden states h [B, H] come from the DFlash head (drafters/block.py `Block.hidden`: before its
final norm); hn = norm(h) is what the block head's own readout reads (base = lm_head(hn)).

    cache_k   = [down_h hn_k ; down_g mean_j hn_j]            [2r]  local + block-global, once a block
    e_k       = down_e rms(embed(prev_k))                     [r]   prev_k: the token at slot k-1
                                                                    (slot 0: the token before the root)
    x_k       = in_proj [cache_k ; e_k]                       [r]
    x         = x + tril(L) x   per rank channel c:  x[k, c] += sum_{j <= k} L[c, k, j] x[j, c]
    x         = x + down(silu(gate(rms(x))) * up(rms(x)))     SwiGLU residual
    refined_k = lm_head(hn_k + up_o x_k)                       [Vd], slots 1..B-1
              = base_k + W2 x_k   with W2 = lm_head up_o       (the bias, low rank through the
                                                                readout: see below)

Causal: slot k reads prev_0..prev_k only (tril), so the drafted token at slot j changes refined
logits at slots > j only. The card writes W1 [V, r] (the previous token's embedding) and W2 [V, r]
(the bias); at SmolLM2's 49,152 tokens those two are 25 MB each in float16, over what we ship, so
here they go through the target's own (frozen, shared) embedding and readout: W1 = down_e embed,
W2 = lm_head up_o. `up_o` starts at zero, so an untrained head refines nothing (refined = base).

`XPressHead.logits` is the fast path (the cache part of in_proj computed once per block and
reused by every Jacobi pass: `features` then `logits_from`); `reference_logits` is the slow one,
written out per position and per channel with plain products, that tests/test_xpress.py checks it
against. Weights: `xpress.safetensors` (NAMES below; metadata `rank`, `block_size`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ...errors import ModelError
from ...models.layers import embedding, linear, rms_norm

FILE = "xpress.safetensors"
NAMES = ("down_h", "down_g", "down_e", "norm_e", "in_c", "in_e", "mix", "mlp_norm", "gate", "up", "down", "up_o")


@dataclass
class XPressWeights:
    down_h: torch.Tensor  # [r, H]
    down_g: torch.Tensor  # [r, H]
    down_e: torch.Tensor  # [r, H]
    norm_e: torch.Tensor  # [H]
    in_c: torch.Tensor  # [r, 2r]: in_proj's columns of the cache (local, global)
    in_e: torch.Tensor  # [r, r]: in_proj's columns of the previous token's embedding
    mix: torch.Tensor  # [r, B, B]: L, only its lower triangle (diagonal included) is read
    mlp_norm: torch.Tensor  # [r]
    gate: torch.Tensor  # [M, r]
    up: torch.Tensor  # [M, r]
    down: torch.Tensor  # [r, M]
    up_o: torch.Tensor  # [H, r]

    @property
    def rank(self) -> int:
        return int(self.down_h.shape[0])

    @property
    def block_size(self) -> int:
        return int(self.mix.shape[-1])

    @staticmethod
    def init(hidden: int, rank: int, block_size: int, seed: int = 0) -> "XPressWeights":
        """Small random projections, L = 0 and up_o = 0: refined = base until trained."""
        g = torch.Generator().manual_seed(seed)
        r, H, M = rank, hidden, 2 * rank

        def rnd(*shape, fan):
            return torch.randn(*shape, generator=g) / fan ** 0.5

        return XPressWeights(rnd(r, H, fan=H), rnd(r, H, fan=H), rnd(r, H, fan=H), torch.ones(H),
                             rnd(r, 2 * r, fan=3 * r), rnd(r, r, fan=3 * r), torch.zeros(r, block_size, block_size),
                             torch.ones(r),
                             rnd(M, r, fan=r), rnd(M, r, fan=r), rnd(r, M, fan=M) * 0.1, torch.zeros(H, r))

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: getattr(self, k) for k in NAMES}

    def save(self, folder: str | Path) -> Path:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().float().contiguous() for k, v in self.tensors().items()}, folder / FILE,
                  metadata={"rank": str(self.rank), "block_size": str(self.block_size)})
        return folder / FILE

    @staticmethod
    def load(path: str | Path) -> "XPressWeights":
        path = Path(path)
        file = path / FILE if path.is_dir() else path
        try:
            t = load_file(file)
        except FileNotFoundError:
            raise ModelError(f"{file} not found: train an xPress head with `outrider train xpress` first") from None
        except (SafetensorError, OSError) as err:
            raise ModelError(f"{file} is not an xPress head ({err}); train it again") from None
        missing = [k for k in NAMES if k not in t]
        if missing:
            raise ModelError(f"{file} is not an xPress head (missing {', '.join(missing)}); train it again")
        return XPressWeights(**{k: t[k] for k in NAMES})


class XPressHead:
    """xPress over a block head `head` (DFlashHead: its final norm, embedding and readout are used, frozen)."""

    def __init__(self, weights: XPressWeights, head, product=linear):
        """product: the matrix product (models.layers.linear, this CPU's fastest path; training
        passes F.linear, whose gradients reach weights that change in place)."""
        self.p, self.head, self._linear = weights, head, product
        self.eps = head.config.rms_norm_eps
        B = weights.block_size
        self._tril = torch.ones(B, B).tril().bool()  # [B, B]

    def fits(self) -> str | None:
        """None, or why these weights do not fit the block head."""
        H, B = self.head.config.hidden_size, self.head.block_size
        if self.p.down_h.shape[1] != H:
            return f"hidden size {self.p.down_h.shape[1]}, the block head's is {H}"
        if self.p.block_size != B:
            return f"block size {self.p.block_size}, the block head's is {B}"
        return None

    def features(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: [S, B, H] block hidden states -> (hn [S, B, H] the readout's input, c [S, B, r]:
        the cache part of in_proj, computed once a block)."""
        p = self.p
        hn = rms_norm(hidden, self.head.w.norm, self.eps)  # [S, B, H]
        local = self._linear(hn, p.down_h)  # [S, B, r]
        glob = self._linear(hn.mean(1, keepdim=True), p.down_g).expand_as(local)  # [S, B, r]
        c = self._linear(torch.cat((local, glob), -1), p.in_c)  # [S, B, r]
        return hn, c

    def logits_from(self, hn: torch.Tensor, c: torch.Tensor, prev: torch.Tensor, first: int = 1) -> torch.Tensor:
        """hn, c from `features`, prev: [S, T] long target ids (slots 0..T-1, T <= B) -> refined
        logits [S, T-first, Vd] float32 of slots first..T-1 (only those rows are read out)."""
        p = self.p
        T = prev.shape[1]
        e = rms_norm(embedding(prev.to(hn.device), self.head.w.embed).to(hn.dtype), p.norm_e, self.eps)  # [S, T, H]
        x = c[:, :T] + self._linear(self._linear(e, p.down_e), p.in_e)  # [S, T, r]
        L = (p.mix[:, :T, :T] * self._tril[:T, :T]).to(x.dtype)  # [r, T, T]
        x = x + torch.einsum("ckj,sjc->skc", L, x)  # the causal mixer
        n = rms_norm(x, p.mlp_norm, self.eps)
        x = x + self._linear(F.silu(self._linear(n, p.gate)) * self._linear(n, p.up), p.down)  # [S, T, r]
        out = hn[:, first:T] + self._linear(x[:, first:], p.up_o)  # [S, T-first, H]
        return self._linear(out, self.head.w.lm_head).float()  # [S, T-first, Vd]

    def logits(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """hidden: [S, B, H], prev: [S, B] -> refined [S, B-1, Vd]."""
        hn, c = self.features(hidden)
        return self.logits_from(hn, c, prev)


def _dense(w) -> torch.Tensor:
    return w if isinstance(w, torch.Tensor) else w.dequantize()


def reference_logits(weights: XPressWeights, head, hidden: torch.Tensor, prev: list[int]) -> torch.Tensor:
    """The slow path: one block, hidden [B, H], prev [B] -> refined [B-1, Vd] as base + W2 x,
    position by position and channel by channel (no cache reuse, no einsum)."""
    p, eps = weights, head.config.rms_norm_eps
    w = head.w
    B, r = hidden.shape[0], p.rank

    def norm(v, g):
        return g * (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps))

    hn = norm(hidden.float(), w.norm.float())  # [B, H]
    g = hn.mean(0)  # [H]
    embed = _dense(w.embed).float()
    xs = []
    for k in range(B):
        cache = torch.cat((p.down_h @ hn[k], p.down_g @ g))  # [2r]
        e = p.down_e @ norm(embed[prev[k]], p.norm_e)  # [r]
        xs.append(torch.cat((p.in_c, p.in_e), 1) @ torch.cat((cache, e)))  # in_proj [r, 3r] @ [3r]
    x = torch.stack(xs)  # [B, r]
    mixed = x.clone()
    for k in range(B):
        for ch in range(r):
            mixed[k, ch] = x[k, ch] + sum(float(p.mix[ch, k, j]) * x[j, ch] for j in range(k + 1))
    out = []
    readout = _dense(w.lm_head).float()  # [Vd, H]
    for k in range(1, B):
        y = mixed[k]
        n = norm(y, p.mlp_norm)
        y = y + p.down @ (F.silu(p.gate @ n) * (p.up @ n))
        base = readout @ hn[k]
        bias = (readout @ p.up_o) @ y  # W2 x
        out.append(base + bias)
    return torch.stack(out)  # [B-1, Vd]
