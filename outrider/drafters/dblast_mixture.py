"""DBLast's mixture head: a low-rank latent mixture over a DFlash block's positions.

A DFlash block gives position k (1..K, K = B-1) a distribution of its own, independent of the
tokens drafted at the other positions. DBLast (arXiv 2608.05448; seed card 2.15) makes the block
dependent: a latent component z in 1..M picks one coherent reading of the whole block,

    q(x_1..x_K) = sum_z pi(z) prod_k q_k(x_k | z)

Shapes: H the head's hidden size, K = B-1 positions, M components, r the rank, Vd the draft
vocabulary. From the block's hidden states h [B, H] (DFlashHead.block) and its logits l [K, Vd]:

    n_k      = norm(h_k)                                     [K, H]   the head's own final norm
    a_{z,k}  = comp_z n_k + bias_{z,k}                        [M, K, r]
    logits   = l_k + a_{z,k} readout,  readout = lm_head(proj^T)   [M, K, Vd]: a rank-r offset per
               component (proj [H, r] moves the normed state; through the shared lm_head)
    pi       = softmax(gate cat(norm(h_0), mean_k n_k) + gate_bias)                     [M]

`proj` starts at 0, so an untrained mixture is the DFlash block itself (every component equal).
Weights: `dblast.safetensors` (`comp` [M, r, H], `bias` [M, K, r], `proj` [H, r], `gate` [M, 2H],
`gate_bias` [M]); `mixture_logits` is the one formula, used by the drafter and by training
(train/dblast.py). The chain built from it and its exact proposal: drafters/dblast_chain.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..errors import ConfigError, ModelError
from ..models.layers import linear, rms_norm

FILE = "dblast.safetensors"
NAMES = ("comp", "bias", "proj", "gate", "gate_bias")


@dataclass
class MixtureWeights:
    comp: torch.Tensor  # [M, r, H]
    bias: torch.Tensor  # [M, K, r]
    proj: torch.Tensor  # [H, r]
    gate: torch.Tensor  # [M, 2H]
    gate_bias: torch.Tensor  # [M]

    @property
    def components(self) -> int:
        return int(self.comp.shape[0])

    @property
    def rank(self) -> int:
        return int(self.comp.shape[1])

    @property
    def positions(self) -> int:
        return int(self.bias.shape[1])

    @staticmethod
    def init(components: int, rank: int, positions: int, hidden: int, seed: int = 0,
             scale: float = 0.02) -> "MixtureWeights":
        """Random component maps, zero offsets (`proj` = 0): the DFlash block itself."""
        g = torch.Generator().manual_seed(seed)
        return MixtureWeights(torch.randn(components, rank, hidden, generator=g) * scale,
                              torch.randn(components, positions, rank, generator=g) * scale,
                              torch.zeros(hidden, rank), torch.randn(components, 2 * hidden, generator=g) * scale,
                              torch.zeros(components))

    def save(self, folder) -> Path:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / FILE
        save_file({n: getattr(self, n).detach().float().contiguous() for n in NAMES}, str(path))
        return path


def load_weights(path) -> MixtureWeights:
    """A `dblast.safetensors` file (or the folder holding one); ModelError naming what is wrong."""
    path = Path(path)
    if path.is_dir():
        path = path / FILE
    if not path.is_file():
        raise ConfigError(f"no DBLast mixture at {path} (train one: python -m outrider.train.dblast)")
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as err:
        raise ModelError(f"{path}: not a readable safetensors file ({err})") from None
    missing = [n for n in NAMES if n not in tensors]
    if missing:
        raise ModelError(f"{path}: a DBLast mixture needs tensors {', '.join(NAMES)}; missing {', '.join(missing)}")
    w = MixtureWeights(*(tensors[n].float() for n in NAMES))
    M, r, H = w.comp.shape
    want = {"bias": (M, w.positions, r), "proj": (H, r), "gate": (M, 2 * H), "gate_bias": (M,)}
    for name, shape in want.items():
        if tuple(getattr(w, name).shape) != shape:
            raise ModelError(f"{path}: {name} is {tuple(getattr(w, name).shape)}, expected {shape} "
                             f"(comp is [M {M}, r {r}, H {H}])")
    return w


def mixture_parts(w: MixtureWeights, h: torch.Tensor, positions: int, norm: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """h: [..., B, H] block hidden states -> (log_pi [..., M], a [..., M, K, r]) for K = `positions`."""
    K = positions
    n = rms_norm(h.float(), norm.float(), eps)  # [..., B, H]
    a = torch.einsum("mrh,...kh->...mkr", w.comp, n[..., 1:1 + K, :]) + w.bias[:, :K]  # [..., M, K, r]
    features = torch.cat((n[..., 0, :], n[..., 1:1 + K, :].mean(-2)), dim=-1)  # [..., 2H]
    return torch.log_softmax(features @ w.gate.T + w.gate_bias, dim=-1), a


def mixture_logits(w: MixtureWeights, readout: torch.Tensor, h: torch.Tensor, base: torch.Tensor, norm: torch.Tensor,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The formula (module docstring), batched over leading dims.

    h: [..., B, H] block hidden states; base: [..., K, Vd] the block's logits (K <= B-1);
    readout: [r, Vd]; norm: [H] the head's final norm -> (log_pi [..., M], logits [..., M, K, Vd])."""
    log_pi, a = mixture_parts(w, h, base.shape[-2], norm, eps)
    return log_pi, base.float().unsqueeze(-3) + a @ readout  # [..., M, K, Vd]


def mixture_reference(w: MixtureWeights, lm_head: torch.Tensor, h: torch.Tensor, base: torch.Tensor,
                      norm: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The slow form of `mixture_logits` for one block, component by component and position by
    position (lm_head: [Vd, H] float). h: [B, H], base: [K, Vd] -> (log_pi [M], logits [M, K, Vd])."""
    def normed(x):
        return x / torch.sqrt(x.pow(2).mean() + eps) * norm

    K = base.shape[0]
    n = [normed(h[k].float()) for k in range(K + 1)]
    score = w.gate @ torch.cat((n[0], torch.stack(n[1:]).mean(0))) + w.gate_bias  # [M]
    rows = [[base[k].float() + lm_head @ (w.proj @ (w.comp[z] @ n[k + 1] + w.bias[z, k])) for k in range(K)]
            for z in range(w.components)]
    return torch.log_softmax(score, -1), torch.stack([torch.stack(r) for r in rows])


class MixtureHead:
    """The mixture over a DFlash head (`head`: DFlashHead; its norm and lm_head are read, not copied)."""

    def __init__(self, weights: MixtureWeights, head):
        c = head.config
        if weights.comp.shape[2] != c.hidden_size:
            raise ConfigError(f"the DBLast mixture is for hidden size {weights.comp.shape[2]}, the DFlash head has "
                              f"{c.hidden_size}")
        if weights.positions < c.block_size - 1:
            raise ConfigError(f"the DBLast mixture covers {weights.positions} positions, the DFlash head drafts "
                              f"{c.block_size - 1}")
        self.w, self.head = weights, head
        with torch.inference_mode():
            self.readout = linear(weights.proj.T.contiguous().to(head.dtype), head.w.lm_head).float()  # [r, Vd]

    @property
    def components(self) -> int:
        return self.w.components

    @torch.inference_mode()
    def __call__(self, hidden: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: [B, H], logits: [K, Vd] one block -> (log_pi [M], logits [M, K, Vd]) float32."""
        return mixture_logits(self.w, self.readout, hidden, logits, self.head.w.norm, self.head.config.rms_norm_eps)
