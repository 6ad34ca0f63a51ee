"""A vision-language model's image side: the SigLIP-style vision encoder and the pixel-shuffle
connector of Idefics3 / SmolVLM (models/idefics3.py), as plain torch over weight tensors.

It runs once a prompt, before the prefill: pixels [N, 3, S, S] -> image features [N, K, E_text],
K = (S / patch)^2 / scale^2 rows an image, which replace the embeddings of the prompt's K image
tokens (models/image_prompt.py). The text decoder (models/decoder.py) never sees pixels.

Shapes: N images, C vision hidden size, n = (S / patch)^2 patches, h heads of C / h, F the MLP's
width, r the connector's scale factor, E the text model's hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class VisionConfig:
    """The vision tower's sizes (Idefics3's vision_config, scale_factor and image_token_id)."""

    hidden_size: int  # C
    intermediate_size: int  # F
    num_layers: int
    num_heads: int
    image_size: int  # S: an image is S x S pixels (no splitting, no padding: docs/models.md)
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    scale_factor: int  # r: the pixel shuffle folds r x r patches into one text row
    image_token_id: int  # the prompt token each image row replaces
    text_hidden_size: int  # E

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def rows_per_image(self) -> int:
        """K: text rows (image tokens) one image becomes."""
        return self.patches_per_side ** 2 // self.scale_factor ** 2


@dataclass
class VisionLayer:
    norm1: tuple[torch.Tensor, torch.Tensor]  # LayerNorm weight, bias [C]
    qkv: torch.Tensor  # [3C, C]: q, k, v projections stacked
    qkv_bias: torch.Tensor  # [3C]
    out: torch.Tensor  # [C, C]
    out_bias: torch.Tensor  # [C]
    norm2: tuple[torch.Tensor, torch.Tensor]
    fc1: torch.Tensor  # [F, C]
    fc1_bias: torch.Tensor  # [F]
    fc2: torch.Tensor  # [C, F]
    fc2_bias: torch.Tensor  # [C]


@dataclass
class VisionTower:
    config: VisionConfig
    patch: torch.Tensor  # [C, 3, P, P]: the patch embedding (a convolution of stride P)
    patch_bias: torch.Tensor  # [C]
    positions: torch.Tensor  # [n, C]: one learned row a patch position
    layers: list[VisionLayer]
    post_norm: tuple[torch.Tensor, torch.Tensor]  # [C] each
    projection: torch.Tensor  # [E, C r^2]: the connector's modality projection (no bias)

    @torch.inference_mode()
    def features(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [N, 3, S, S] (normalized) -> image features [N, K, E], the rows that replace each
        image's K image tokens, in the text model's dtype."""
        c = self.config
        x = encode(self, pixels.to(self.patch.dtype))  # [N, n, C]
        return F.linear(pixel_shuffle(x, c.scale_factor), self.projection)  # [N, K, E]


def encode(tower: VisionTower, pixels: torch.Tensor) -> torch.Tensor:
    """The vision encoder: patches, learned positions, pre-norm bidirectional attention blocks with
    a GELU-tanh MLP, a last LayerNorm. pixels [N, 3, S, S] -> [N, n, C]."""
    c = tower.config
    x = F.conv2d(pixels, tower.patch, tower.patch_bias, stride=c.patch_size)  # [N, C, S/P, S/P]
    x = x.flatten(2).transpose(1, 2)  # [N, n, C], patches row by row
    # a whole S x S image: patch i at position i (transformers' bucketed positions reduce to this)
    x = x + tower.positions[: x.shape[1]]
    for w in tower.layers:
        x = x + _attention(w, F.layer_norm(x, (c.hidden_size,), *w.norm1, c.layer_norm_eps), c.num_heads)
        h = F.layer_norm(x, (c.hidden_size,), *w.norm2, c.layer_norm_eps)
        x = x + F.linear(F.gelu(F.linear(h, w.fc1, w.fc1_bias), approximate="tanh"), w.fc2, w.fc2_bias)
    return F.layer_norm(x, (c.hidden_size,), *tower.post_norm, c.layer_norm_eps)


def _attention(w: VisionLayer, h: torch.Tensor, heads: int) -> torch.Tensor:
    """Every patch attends to every patch of its image. h [N, n, C] -> [N, n, C]."""
    N, n, C = h.shape
    q, k, v = F.linear(h, w.qkv, w.qkv_bias).view(N, n, 3, heads, C // heads).permute(2, 0, 3, 1, 4)  # [N, h, n, C/h] each
    scores = (q @ k.transpose(-1, -2)) * (C // heads) ** -0.5  # [N, h, n, n]
    out = torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v  # [N, h, n, C/h]
    return F.linear(out.transpose(1, 2).reshape(N, n, C), w.out, w.out_bias)


def pixel_shuffle(x: torch.Tensor, r: int) -> torch.Tensor:
    """Fold each r x r block of patches into one row: [N, n, C] -> [N, n / r^2, C r^2]. Row
    (i, j) of the (side / r)^2 grid holds, in order, the patches (i r + a, j r + b) for a, then b
    within the block (Idefics3's connector's order)."""
    N, n, C = x.shape
    side = int(round(n ** 0.5))
    x = x.view(N, side, side // r, C * r)  # [N, rows, column blocks, r patches of a row]
    x = x.permute(0, 2, 1, 3).reshape(N, side // r, side // r, C * r * r)  # [N, column blocks, row blocks, ..]
    return x.permute(0, 2, 1, 3).reshape(N, n // (r * r), C * r * r)
