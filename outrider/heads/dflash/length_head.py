"""AdaFlash's adaptive length head: how many of a drafted block's tokens the target verifies.

AdaFlash (SGLang PR #34171; seed card 2.28 (ii), its `ThreshHeadTwoModel`) predicts the
verification-length ratio of a block from the draft's own hidden states, mean-pooled and at the
last position, and the target verifies only that many tokens. Here, for a block's hidden states
h [B, H] (the DFlash head's last layer before its final norm, slot 0 the root; `DFlashHead.block`):

    f        = cat(rms(mean_b h_b), rms(h_{B-1}))          [2H]  (rms: divided by its RMS, no weight)
    ratio    = sigmoid(w2 . silu(W1 f + b1) + b2)          in (0, 1), W1 [width, 2H], w2 [1, width]
    verified = clamp(round(ratio * K) + margin, 1, K)      K = B-1 drafted tokens; margin default 1

It is trained by regression (squared error) on the observed accepted length over K of blocks the
frozen head drafts at random anchors of the training data, accepted as the greedy verifier would
along the drafted prefix (heads/dflash/opd.py scores it): `outrider train dflash --objective
length --init-from HEAD` (the one training loop, train/loop.py). The verify length is decided from
draft-side features before the target runs, and the target verifies a prefix of the block, so
greedy speculation stays token for token equal to plain decoding (drafters/adaflash.py).
The file: `adaflash.safetensors` beside the head (`up.weight`, `up.bias`, `out.weight`, `out.bias`;
metadata: hidden_size, width, block_size).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ...errors import ConfigError
from ..trainable import StepOutput
from .opd import target_along_drafts

FILE = "adaflash.safetensors"
DEFAULT_MARGIN = 1


def _unit_rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def pooled(hidden: torch.Tensor) -> torch.Tensor:
    """hidden [..., B, H] -> f [..., 2H] (module notes), float32."""
    h = hidden.float()
    return torch.cat((_unit_rms(h.mean(-2)), _unit_rms(h[..., -1, :])), dim=-1)


def pooled_reference(hidden: torch.Tensor) -> torch.Tensor:
    """The slow reference of `pooled` for one block [B, H]: sums by hand, float64."""
    h = hidden.double()
    B, H = h.shape
    mean = [sum(float(h[b, j]) for b in range(B)) / B for j in range(H)]
    last = [float(h[B - 1, j]) for j in range(H)]
    unit = lambda v: [x / ((sum(y * y for y in v) / len(v) + 1e-6) ** 0.5) for x in v]  # noqa: E731
    return torch.tensor(unit(mean) + unit(last), dtype=torch.float64)


def verify_length(ratio: float, drafted: int, margin: int = DEFAULT_MARGIN) -> int:
    """How many of `drafted` tokens the target verifies: clamp(round(ratio * K) + margin, 1, K)."""
    return max(1, min(drafted, int(round(ratio * drafted)) + margin))


class LengthHead(torch.nn.Module):
    def __init__(self, hidden_size: int, width: int = 256, block_size: int = 16, seed: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.hidden_size, self.width, self.block_size = hidden_size, width, block_size
        self.up = torch.nn.Linear(2 * hidden_size, width)
        self.out = torch.nn.Linear(width, 1)
        with torch.no_grad():
            self.up.weight.copy_(torch.randn(width, 2 * hidden_size, generator=gen) * (2 * hidden_size) ** -0.5)
            self.up.bias.zero_()
            self.out.weight.copy_(torch.randn(1, width, generator=gen) * 0.01)
            self.out.bias.zero_()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., B, H] -> the predicted accepted ratio [...] in (0, 1)."""
        return torch.sigmoid(self.out(F.silu(self.up(pooled(hidden)))).squeeze(-1))

    @torch.no_grad()
    def verified(self, hidden: torch.Tensor, margin: int = DEFAULT_MARGIN) -> int:
        """One block's hidden states [B, H] -> the tokens the target verifies (module notes)."""
        return verify_length(float(self(hidden)), hidden.shape[0] - 1, margin)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().float().contiguous().cpu() for k, v in self.state_dict().items()}

    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        meta = {"hidden_size": str(self.hidden_size), "width": str(self.width), "block_size": str(self.block_size)}
        save_file(self.tensors(), str(path), metadata=meta)

    @classmethod
    def load(cls, path: str | Path) -> "LengthHead":
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{path}: no AdaFlash length head there; train one with `outrider train dflash "
                              f"--objective length --init-from HEAD` or give length=FILE")
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        try:
            head = cls(int(meta["hidden_size"]), int(meta["width"]), int(meta["block_size"]))
            head.load_state_dict(tensors)
        except (KeyError, ValueError, RuntimeError) as err:
            raise ConfigError(f"{path}: not an AdaFlash length head ({type(err).__name__}: {err})"[:300]) from None
        return head.eval()


class LengthTrainable(torch.nn.Module):
    """The frozen DFlash head and the length head it feeds: what the loop trains under
    `--objective length`; it exports the head unchanged and the length head as FILE."""

    kind = "dflash"

    def __init__(self, dflash, width: int, seed: int):  # dflash: trainable.DFlashTrainable
        super().__init__()
        self.dflash = dflash
        for p in dflash.parameters():
            p.requires_grad_(False)
        self.length = LengthHead(dflash.config.hidden_size, width, dflash.config.block_size, seed)

    def taps(self, num_target_layers: int) -> tuple[int, ...]:
        return self.dflash.taps(num_target_layers)

    def calibrate(self, features, valid=None, keep_function: bool = False) -> None:
        self.dflash.calibrate(features, valid, keep_function=keep_function)

    def state_tensors(self, training: bool = False) -> dict[str, torch.Tensor]:
        out = self.dflash.state_tensors(training)
        if training:
            out.update({"length." + k: v for k, v in self.length.tensors().items()})
        return out

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        own = {k[len("length."):]: v for k, v in tensors.items() if k.startswith("length.")}
        self.dflash.load_state_tensors({k: v for k, v in tensors.items() if not k.startswith("length.")})
        if own:
            self.length.load_state_dict(own)

    def export_config(self, **extra) -> dict:
        return self.dflash.export_config(**extra)

    def extra_files(self) -> dict:
        """Files written beside the head (train/outputs.py): the length head."""
        return {FILE: self.length.save}


def length_step(model: LengthTrainable, target, tb, generator: torch.Generator, count: int) -> StepOutput:
    """Blocks at `count` random anchors drafted by the frozen head, accepted along the drafted
    prefix as the greedy verifier would; squared error of the predicted ratio against accepted / K.
    One position: the summed error, the blocks, and those whose rounded prediction is exact."""
    d = model.dflash
    K = d.config.block_size - 1
    S, T = tb.tokens.shape
    anchors, real = d.anchors(tb.valid, count, generator)  # [S, A]
    with torch.no_grad():
        logits, hidden = d.block_logits(tb.features, tb.tokens, anchors, with_hidden=True)  # [S,A,K,Vd], [S,A,B,H]
        drafted = d.used[logits.argmax(-1)]  # [S, A, K]
        p = target_along_drafts(target, tb.tokens, [T] * S, anchors, real, drafted)  # [S, A, K, V]
        run = ((drafted.cpu() == p.argmax(-1)).long().cumprod(-1).sum(-1)).to(hidden.device)  # [S, A]
    ratio = model.length(hidden.detach().float())  # [S, A]
    err = (ratio - run.float() / K).pow(2)[real]
    exact = (torch.round(ratio.detach() * K) == run)[real]
    return StepOutput([err.sum()], [int(real.sum())], [float(exact.sum())], accepted=float(run[real].sum()),
                      blocks=int(real.sum()))


@dataclass
class LengthJob:
    model: LengthTrainable
    target: object
    seed: int
    anchors: int
    needs_logits = False
    first = 0

    def weights(self) -> list[float]:
        return [1.0]

    def step(self, tb, step: int, rank: int) -> StepOutput:
        key = hashlib.sha256(f"adaflash-length:{self.seed}:{step}:{rank}".encode()).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") >> 1)
        return length_step(self.model, self.target, tb, generator, self.anchors)
