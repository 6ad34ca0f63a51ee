"""DFly (AngelSpec, seed card 2.25): a DFlash head with per-draft-layer contexts and a chained predecessor correction.

Shapes: H the head's hidden size (= the target's, Ht), L draft layers, n taps of the DFlash head,
m mix taps (target layers the mix reads), B the block size, Vd the draft vocabulary, r the rank of
the correction. Over a DFlash head (heads/dflash/head.py), unchanged, DFly adds:

    context   c_l(p) = hidden_norm(fc(cat(taps of p)) + gate_l * proj(sum_j s_lj * rms(f_j(p))))
              s_l = softmax(mix_logits[l]) over the m mix taps; f_j(p) the raw feature of mix tap j
              at position p, rms() its RMS normalisation (no weight); proj [H, Ht] one projection
              shared by every layer and tap. Draft layer l's K/V come from c_l: every layer has its
              own context (the "hybrid target conditioning" of the llama.cpp port).
    readout   slot k (1..B-1): logits_k = lm_head(norm(h_k + pred_up(pred_down(embed(t_{k-1})))))
              h_k the block's last hidden state of slot k, t_0 the root, t_{k-1} the token drafted
              at slot k-1: the correction is chained across the block, one slot after another
              ("TreeFlash predecessor correction").

With gate = 0 and pred_up = 0 (how training starts, train/dfly.py) DFly computes exactly its
DFlash head. The weights live in `dfly.safetensors` beside the DFlash head (tensors below, the mix
taps in the metadata, DFlash's layer-id convention), so a shipped DFlash head carries its DFly.

`DFlyHead` is the fast path (the DFlash head's cache and block forward, the context written per
layer, the readout chained slot by slot); `block_logits` is the slow one, differentiable, that
recomputes everything from the context rows for a set of anchors (training and tests).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ...errors import ModelError
from ...models.layers import apply_rotary, embedding, linear, rms_norm, rotary_tables
from ..layer import attend_and_mlp
from ..taps import taps as to_taps
from .head import DFlashHead

FILE = "dfly.safetensors"


@dataclass
class DFlyWeights:
    mix_ids: tuple[int, ...]  # the mix taps, DFlash's convention (id l: the output of layer l, 0-based)
    mix_logits: torch.Tensor  # [L, m]
    gate: torch.Tensor  # [L]
    proj: torch.Tensor  # [H, Ht]
    pred_down: torch.Tensor  # [r, H]
    pred_up: torch.Tensor  # [H, r]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"dfly.mix_logits": self.mix_logits, "dfly.gate": self.gate, "dfly.proj.weight": self.proj,
                "dfly.pred_down.weight": self.pred_down, "dfly.pred_up.weight": self.pred_up}

    def save(self, folder: str | Path) -> Path:
        from safetensors.torch import save_file

        path = Path(folder) / FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().float().contiguous() for k, v in self.tensors().items()}, str(path),
                  metadata={"mix_ids": json.dumps(list(self.mix_ids))})
        return path

    @classmethod
    def load(cls, path: str | Path, device, dtype) -> "DFlyWeights":
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise ModelError(f"{path}: no DFly weights; train them with `outrider train dfly` (docs/methods.md#dfly)")
        with safe_open(str(path), framework="pt") as f:
            ids = json.loads((f.metadata() or {}).get("mix_ids", "null"))
            got = {k: f.get_tensor(k).to(device=device, dtype=dtype) for k in f.keys()}
        names = ("dfly.mix_logits", "dfly.gate", "dfly.proj.weight", "dfly.pred_down.weight", "dfly.pred_up.weight")
        if not isinstance(ids, list) or any(n not in got for n in names):
            raise ModelError(f"{path}: not DFly weights (needs {', '.join(names)} and the mix_ids metadata)")
        return cls(tuple(ids), *(got[n] for n in names))


class DFlyHead:
    """A DFlash head with DFly's contexts and readout; what DFlashDrafter needs of a head, plus `correct`."""

    def __init__(self, base: DFlashHead, extra: DFlyWeights, num_target_layers: int):
        c = base.config
        L, m = extra.mix_logits.shape
        if L != c.num_layers or m != len(extra.mix_ids) or extra.proj.shape != (c.hidden_size, c.target_hidden_size):
            raise ModelError(f"DFly weights for {L} layers and {m} mix taps (proj {list(extra.proj.shape)}) do not fit "
                             f"this DFlash head ({c.num_layers} layers, H {c.hidden_size}, Ht {c.target_hidden_size})")
        if any(not 0 <= i < num_target_layers for i in extra.mix_ids):
            raise ModelError(f"DFly mix taps {list(extra.mix_ids)} are not all layers of this {num_target_layers}-layer target")
        self.base, self.extra, self.config, self.w = base, extra, c, base.w
        own = base.config.taps(num_target_layers)
        mix = to_taps(extra.mix_ids, "sglang")
        self.taps = tuple(dict.fromkeys(own + mix))  # what the drafter declares: the DFlash taps, then the mix's
        self._own = [self.taps.index(t) for t in own]
        self._mix = [self.taps.index(t) for t in mix]

    device = property(lambda self: self.base.device)
    dtype = property(lambda self: self.base.dtype)
    block_size = property(lambda self: self.base.block_size)

    def new_cache(self, num_slots: int, max_len: int):
        return self.base.new_cache(num_slots, max_len)

    def contexts(self, features: torch.Tensor) -> torch.Tensor:
        """features: [m, n', Ht] (this head's `taps`) -> context rows [m, L, H], one per draft layer."""
        c, e = self.config, self.extra
        base = linear(features[:, self._own].flatten(1).to(self.dtype), self.w.fc)  # [m, H]
        mixed = rms_norm(features[:, self._mix].to(self.dtype), torch.ones_like(e.proj[0]), c.rms_norm_eps)  # [m, j, Ht]
        shares = torch.softmax(e.mix_logits, dim=-1)  # [L, j]
        per_layer = torch.einsum("lj,mjh->mlh", shares, mixed)  # [m, L, Ht]
        added = linear(per_layer, e.proj) * e.gate.view(1, -1, 1)  # [m, L, H]
        return rms_norm(base.unsqueeze(1) + added, self.w.hidden_norm, c.rms_norm_eps)

    fuse = contexts  # the drafter's name for it (DFlashDrafter: pending rows [m, L, H])

    @torch.inference_mode()
    def write_context(self, cache, slot: int, start: int, rows: torch.Tensor) -> None:
        """rows: [m, L, H] (`contexts`): draft layer l's K/V from its own context rows."""
        m = rows.shape[0]
        if m == 0:
            return
        positions = torch.arange(start, start + m, device=self.device).unsqueeze(0)
        cos, sin = rotary_tables(positions, self.base.inv_freq, self.dtype)
        for l, layer in enumerate(self.w.layers):
            k, v = self.base._kv(layer, rows[:, l].unsqueeze(0), cos, sin)  # noqa: SLF001 (the kind's own head)
            cache.write_slot(l, slot, start, k[0], v[0])

    def block(self, cache, slots, context, tokens):
        return self.base.block(cache, slots, context, tokens)

    def correct(self, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] a slot's block hidden state, previous [...] long the token drafted one slot
        before (target ids) -> the slot's logits [..., Vd] float32."""
        e = self.extra
        emb = embedding(previous.to(self.device).view(1, -1), self.w.embed).to(self.dtype).view(*previous.shape, -1)
        h = hidden + linear(linear(emb, e.pred_down), e.pred_up)
        return linear(rms_norm(h, self.w.norm, self.config.rms_norm_eps), self.w.lm_head).float()

    def target_ids(self, draft_ids):
        return self.base.target_ids(draft_ids)

    def target_logits(self, logits):
        return self.base.target_logits(logits)


def block_logits(head: DFlyHead, features: torch.Tensor, tokens: torch.Tensor, anchors: list[int]) -> torch.Tensor:
    """The slow path, differentiable in DFly's weights: features [n, n', Ht] of positions 0..n-1,
    tokens [n'' >= max anchor + B - 1] long the text; for each anchor a the block [x_a, MASK...] over
    the context rows 0..a-1, its slots corrected by the text's own previous tokens (teacher
    forcing: slot k by x_{a+k-1}). Returns logits [A, B-1, Vd]. Use under
    `config.overriding(linear="linear")` when gradients are wanted (plain F.linear)."""
    c, w = head.config, head.w
    B, nh, G, D, eps = c.block_size, c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps
    ctx = head.contexts(features)  # [n, L, H]
    n, A = ctx.shape[0], len(anchors)
    at = torch.tensor(anchors, device=head.device)  # [A]
    block = torch.full((A, B), c.mask_token_id, dtype=torch.long, device=head.device)
    block[:, 0] = tokens[at]
    h = embedding(block, w.embed).to(head.dtype)  # [A, B, H]
    cos_b, sin_b = rotary_tables(at.unsqueeze(1) + torch.arange(B, device=head.device), head.base.inv_freq, head.dtype)
    cos_c, sin_c = rotary_tables(torch.arange(n, device=head.device).unsqueeze(0), head.base.inv_freq, head.dtype)
    seen = (torch.arange(n, device=head.device).unsqueeze(0) < at.unsqueeze(1))  # [A, n]
    mask = torch.cat((seen, seen.new_ones(A, B)), dim=1)[:, None, None, :].expand(A, 1, B, n + B)
    for l, layer in enumerate(w.layers):
        x = rms_norm(h, layer.input_norm, eps)
        q = apply_rotary(rms_norm(linear(x, layer.q).view(A, B, nh, D), layer.q_norm, eps).transpose(1, 2), cos_b, sin_b)
        kb, vb = head.base._kv(layer, x, cos_b, sin_b)  # noqa: SLF001  [A, G, B, D]
        kc, vc = head.base._kv(layer, ctx[:, l].unsqueeze(0), cos_c, sin_c)  # noqa: SLF001  [1, G, n, D]
        keys = torch.cat((kc.expand(A, -1, -1, -1), kb), dim=2)
        values = torch.cat((vc.expand(A, -1, -1, -1), vb), dim=2)
        h = attend_and_mlp(h, q, keys, values, mask, layer.o, layer.post_norm, layer.gate_up, layer.down, eps)
    previous = tokens[at.unsqueeze(1) + torch.arange(B - 1, device=head.device)]  # [A, B-1]: x_{a+k-1}
    return head.correct(h[:, 1:], previous)
