"""A vision-language model's weights (Idefics3 / SmolVLM: models/idefics3.py): its text model's
tensors under the names the decoder's loader reads (`TextPart`), and its vision tower
(`load_vision`: models/vision_encoder.py), each with its own check that every tensor was read."""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import ModelError
from ..models.vision_encoder import VisionConfig, VisionLayer, VisionTower

TEXT, VISION, CONNECTOR = "model.text_model.", "model.vision_model.", "model.connector."


class TextPart:
    """A VLM's weights seen as its text model's: `model.X` is read from `model.text_model.X`
    (lm_head.weight keeps its name); the vision tower's tensors are not among its names."""

    def __init__(self, source, names: set[str]):
        """names: every tensor name `source` holds (loader.tensor_names)."""
        self.source = source
        self.where = {_text_name(n): n for n in names if n.startswith(TEXT) or n == "lm_head.weight"}

    def _name(self, name: str) -> str:
        return self.where.get(name, name)

    def has(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if name not in self.where:
            raise ModelError(f"weights are missing tensor '{TEXT + name[len('model.'):]}'; the folder is incomplete "
                             "or not this architecture")
        return self.source.get(self.where[name], dtype, device)

    def projection(self, names: list[str], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        parts = [self.get(name, dtype, device) for name in names]
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def _text_name(name: str) -> str:
    return "model." + name[len(TEXT):] if name.startswith(TEXT) else name


def load_vision(source, names: set[str], config: VisionConfig, dtype: torch.dtype, device: torch.device,
                folder: Path) -> VisionTower:
    """The vision encoder and connector from `source` (a folder's safetensors, holding `names`), in `dtype`."""
    read: set[str] = set()

    def get(name: str) -> torch.Tensor:
        read.add(name)
        return source.get(name, dtype, device)

    def norm(name: str) -> tuple[torch.Tensor, torch.Tensor]:
        return get(name + ".weight"), get(name + ".bias")

    layers = []
    for i in range(config.num_layers):
        p = f"{VISION}encoder.layers.{i}."
        attn = p + "self_attn."
        layers.append(VisionLayer(
            norm1=norm(p + "layer_norm1"),
            qkv=torch.cat([get(attn + f"{n}_proj.weight") for n in "qkv"]),
            qkv_bias=torch.cat([get(attn + f"{n}_proj.bias") for n in "qkv"]),
            out=get(attn + "out_proj.weight"), out_bias=get(attn + "out_proj.bias"),
            norm2=norm(p + "layer_norm2"),
            fc1=get(p + "mlp.fc1.weight"), fc1_bias=get(p + "mlp.fc1.bias"),
            fc2=get(p + "mlp.fc2.weight"), fc2_bias=get(p + "mlp.fc2.bias")))
    tower = VisionTower(
        config=config,
        patch=get(VISION + "embeddings.patch_embedding.weight"),
        patch_bias=get(VISION + "embeddings.patch_embedding.bias"),
        positions=get(VISION + "embeddings.position_embedding.weight"),
        layers=layers, post_norm=norm(VISION + "post_layernorm"),
        projection=get(CONNECTOR + "modality_projection.proj.weight"))
    unread = sorted(n for n in names if n.startswith((VISION, CONNECTOR)) and n not in read)
    if unread:
        shown = ", ".join(unread[:3]) + (f" and {len(unread) - 3} more" if len(unread) > 3 else "")
        raise ModelError(f"{folder}: the vision tower keeps tensors this runtime does not read ({shown}); "
                         "they would change its output, so it is not supported yet")
    want = config.patches_per_side ** 2
    if tower.positions.shape[0] != want:
        raise ModelError(f"{folder}: {tower.positions.shape[0]} patch positions, but image_size / patch_size "
                         f"gives {want}")
    return tower
