"""The DSpark head: DFlash's backbone with the anchor as the first prediction position, then a
sequential Markov head and a confidence head (heads/dspark/markov.py).

Shapes: gamma the block size (the anchor and gamma-1 MASK slots), H the head's hidden size, V the
target vocabulary, Vd the draft vocabulary, r the Markov rank. With n committed tokens x_0..x_{n-1}
the anchor x_{n-1} sits in slot 0 at position n-1 and the backbone (heads/dflash/head.py, the same
weights and cached context) runs once over [x_{n-1}, MASK x (gamma-1)]. Unlike DFlash every slot
is read out, so gamma inputs give gamma base logits:

    U_k    = lm_head(norm(h[k-1]))         [Vd]  position k = 1..gamma predicts x_{n-1+k}
    hbar_k = norm(h[k-1])                  [H]   what the Markov and confidence heads read

`anchor_predicts` false (ours, not the paper's) keeps DFlash's readout instead: slots 1..B-1 are
positions 1..gamma = B-1 (h[k] for position k), so a DFlash head's backbone drafts as trained and
only the Markov and confidence heads are new (`outrider train dspark --backbone-mode frozen`).
    logits_k = U_k + bias_k(x_{k-1}, hbar_k, s_{k-1})      (markov.py; x_0 the anchor)
    c_k    = sigmoid(logit_k / T_k)        the calibrated chance that position k is accepted
                                           given positions < k were; survival a_k = c_1 ... c_k

`DSparkHead.block` is the one backbone pass; `step` and `confidence` are one position for N
rows, which drafting (drafters/dspark.py) and PCTree call per concrete parent. The slow
reference is heads/dspark/reference.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...models.layers import rms_norm
from ..dflash.head import DFlashConfig, DFlashHead
from .markov import ConfidenceHead, MarkovHead


@dataclass(frozen=True)
class DSparkConfig:
    backbone: DFlashConfig  # block_size is gamma: every slot a prediction position
    markov_variant: str = "vanilla"  # markov.VARIANTS
    markov_rank: int = 64  # r
    confidence: bool = True  # a confidence head (reading [hbar_k; e_k])
    temperatures: tuple[float, ...] = field(default_factory=tuple)  # [gamma] T_k; () = all 1
    anchor_predicts: bool = True  # the paper's: slot 0 (the anchor) is position 1; False: DFlash's slots 1..B-1

    @property
    def first(self) -> int:
        """The block slot of position 1."""
        return 0 if self.anchor_predicts else 1

    @property
    def gamma(self) -> int:
        """Positions drafted per block."""
        return self.backbone.block_size - self.first

    def temperature(self, k: int) -> float:
        """T of position index k (0-based: position k+1)."""
        return float(self.temperatures[k]) if k < len(self.temperatures) else 1.0


class DSparkHead:
    """The runtime head: `backbone` (a DFlashHead over the target's embedding and readout),
    `markov` (MarkovHead), `conf` (ConfidenceHead or None), `spec` (DSparkConfig)."""

    def __init__(self, spec: DSparkConfig, backbone: DFlashHead, markov: MarkovHead, conf: ConfidenceHead | None):
        self.spec, self.backbone, self.markov, self.conf = spec, backbone, markov, conf
        self.config = backbone.config  # the drafter's machinery reads vocab_size, mask_token_id, hidden_size
        self.w = backbone.w

    # -- what DFlash's drafter machinery calls (drafters/dflash.py) --------------------------------
    @property
    def device(self) -> torch.device:
        return self.backbone.device

    @property
    def dtype(self) -> torch.dtype:
        return self.backbone.dtype

    @property
    def block_size(self) -> int:
        """The block's width B (the anchor and B-1 MASK slots); `gamma` positions are drafted."""
        return self.backbone.block_size

    @property
    def gamma(self) -> int:
        return self.spec.gamma

    def new_cache(self, num_slots: int, max_len: int):
        return self.backbone.new_cache(num_slots, max_len)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        return self.backbone.fuse(features)

    def write_context(self, cache, slot: int, start: int, rows: torch.Tensor) -> None:
        self.backbone.write_context(cache, slot, start, rows)

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.backbone.target_ids(draft_ids)

    def target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return self.backbone.target_logits(logits)

    # -- DSpark ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def block(self, cache, slots: list[int], context: list[int], tokens: torch.Tensor):
        """The backbone pass (DFlashHead.block, slots `spec.first`.. read out): tokens [S, B] (anchor,
        MASK...) -> (U [S, gamma, Vd] float32, hbar [S, gamma, H] the normed hidden states)."""
        first = self.spec.first
        logits, h = self.backbone.block(cache, slots, context, tokens, first=first)
        return logits, rms_norm(h[:, first:], self.w.norm, self.config.rms_norm_eps)

    @torch.inference_mode()
    def step(self, base: torch.Tensor, hidden: torch.Tensor, prev: torch.Tensor, state: torch.Tensor | None = None):
        """One position for N rows: base [N, Vd] (U_k), hidden [N, H] (hbar_k), prev [N] long
        target ids (x_{k-1}), state [N, r] or None -> (logits [N, Vd] float32, state [N, r])."""
        bias, state = self.markov.step(prev.to(self.device), hidden, state)
        return base.float() + bias.float(), state

    @torch.inference_mode()
    def confidence(self, hidden: torch.Tensor, prev: torch.Tensor, k: int) -> torch.Tensor:
        """c_{k+1} for N rows at position index k (0-based): hidden [N, H], prev [N] -> [N] in
        (0, 1), calibrated by T_k; without a confidence head, None."""
        if self.conf is None:
            return None
        logit = self.conf.logit(hidden, self.markov.prev_embeddings(prev.to(self.device)))
        return torch.sigmoid(logit / self.spec.temperature(k))
