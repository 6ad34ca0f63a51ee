"""An image's pixels for a vision-language model (models/idefics3.py): read, resized, split into
tiles and normalized as Idefics3's / SmolVLM's image processor does, with the settings of the
model folder's preprocessor_config.json.

An image is a file: PNG / JPEG / anything Pillow reads (when Pillow is installed), or a pixel
tensor already preprocessed as transformers' processor gives `pixel_values` (a .npy file, a
.safetensors file holding one tensor or `pixel_values`, or a tensor in Python): [3, S, S] (or
[1, 3, S, S], [1, 1, 3, S, S]), one whole image, not split.

A file, as the processor (PIL backend) does it: the longest edge resized to `size.longest_edge`
(aspect kept, the other edge made even); then, when `do_image_splitting` (the processor's default,
where the folder has a preprocessor_config.json; off without one), both edges resized up to
multiples of S and the image cut into rows x cols tiles of S x S, row by row, followed by the whole
image resized to S x S; without splitting, or when the image is S x S or smaller, the image resized
to S x S alone. Lanczos every time; then scaled by `rescale_factor` and normalized by `image_mean`,
`image_std` (1/255, 0.5, 0.5 by default).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ConfigError
from .vision_encoder import VisionConfig


@dataclass(frozen=True)
class ImagePixels:
    """tiles [M, 3, S, S] normalized: rows x cols tiles row by row, then the whole image (M = rows
    cols + 1); or the whole image alone (M = 1, rows = cols = 0)."""

    tiles: torch.Tensor
    rows: int = 0
    cols: int = 0


def read_image(image, vision: VisionConfig, folder: Path | None = None, split: bool | None = None) -> ImagePixels:
    """One image (a path, or a pixel tensor) -> its tiles. split: cut into tiles (None: as the
    folder's preprocessor_config.json says; a tensor is never split)."""
    S = vision.image_size
    if isinstance(image, torch.Tensor):
        return ImagePixels(_checked(image, S, "the image tensor")[None])
    path = Path(image)
    if not path.is_file():
        raise ConfigError(f"image '{image}': no such file")
    if path.suffix.lower() == ".npy":
        import numpy as np

        try:
            array = np.load(path, allow_pickle=False)
        except (ValueError, OSError) as err:
            raise ConfigError(f"image '{image}' is not a readable .npy array ({err})") from None
        return ImagePixels(_checked(torch.from_numpy(array), S, f"image '{image}'")[None])
    if path.suffix.lower() == ".safetensors":
        return ImagePixels(_checked(_safetensors_pixels(path), S, f"image '{image}'")[None])
    raw = _preprocessor(folder)
    if split is None:
        split = bool(raw.get("do_image_splitting", True)) if raw else False
    edge = (raw.get("max_image_size") or {}).get("longest_edge", S) if split else S
    if edge != S:
        raise ConfigError(f"preprocessor_config.json: max_image_size {edge} is not the vision encoder's image_size "
                          f"{S}; tiles of another size are not supported")
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise ConfigError(f"image '{image}': reading image files needs Pillow (pip install pillow); or give the "
                          "pixels as a .npy / .safetensors tensor [3, S, S]") from None
    lanczos = Image.Resampling.LANCZOS
    try:
        with Image.open(path) as img:
            rgb = img.convert("RGB")
            rgb = rgb.resize(longest_edge_size(rgb.width, rgb.height, (raw.get("size") or {}).get("longest_edge") or S),
                             lanczos)
            rows = cols = 0
            if split:
                rgb = rgb.resize(tile_multiple_size(rgb.width, rgb.height, S), lanczos)
                if rgb.width > S or rgb.height > S:
                    rows, cols = rgb.height // S, rgb.width // S
            tiles = [rgb.crop((c * S, r * S, (c + 1) * S, (r + 1) * S)) for r in range(rows) for c in range(cols)]
            tiles.append(rgb if (rgb.width, rgb.height) == (S, S) and not rows else rgb.resize((S, S), lanczos))
    except (UnidentifiedImageError, OSError) as err:
        raise ConfigError(f"image '{image}' is not an image Pillow can read ({type(err).__name__})") from None
    import numpy as np

    pixels = torch.from_numpy(np.stack([np.asarray(t, dtype=np.float32) for t in tiles])).permute(0, 3, 1, 2)  # [M, 3, S, S]
    mean = torch.tensor(raw.get("image_mean") or [0.5] * 3, dtype=torch.float32).view(3, 1, 1)
    std = torch.tensor(raw.get("image_std") or [0.5] * 3, dtype=torch.float32).view(3, 1, 1)
    return ImagePixels((pixels * float(raw.get("rescale_factor") or 1 / 255) - mean) / std, rows, cols)


def read_pixels(image, vision: VisionConfig, folder: Path | None = None) -> torch.Tensor:
    """One image, not split: its normalized pixels [3, S, S]."""
    return read_image(image, vision, folder, split=False).tiles[0]


def longest_edge_size(width: int, height: int, longest: int, cap: int = 4096) -> tuple[int, int]:
    """(width, height) with the longest edge `longest` and the aspect kept, the other edge rounded
    down then up to even, at most `cap` (the processor's first resize, `size.longest_edge`)."""
    if width >= height:
        w, h = longest, int(longest / (width / height))
        h += h % 2
    else:
        h, w = longest, int(longest * (width / height))
        w += w % 2
    h, w = max(h, 1), max(w, 1)
    if w >= h and w > cap:
        w, h = cap, int(cap / (w / h))
    elif h > w and h > cap:
        h, w = cap, int(cap * (w / h))
    return max(w, 1), max(h, 1)


def tile_multiple_size(width: int, height: int, S: int) -> tuple[int, int]:
    """(width, height) resized up to multiples of S, the longer edge first (the processor's
    resize_for_vision_encoder)."""
    aspect = width / height
    if width >= height:
        w = math.ceil(width / S) * S
        return w, math.ceil(int(w / aspect) / S) * S
    h = math.ceil(height / S) * S
    return math.ceil(int(h * aspect) / S) * S, h


def _safetensors_pixels(path: Path) -> torch.Tensor:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            names = list(f.keys())
            name = "pixel_values" if "pixel_values" in names else names[0] if len(names) == 1 else None
            if name is None:
                raise ConfigError(f"image '{path}' holds {len(names)} tensors and none is named pixel_values")
            return f.get_tensor(name)
    except (SafetensorError, OSError) as err:
        raise ConfigError(f"image '{path}' is not a readable .safetensors file ({err})") from None


def _checked(pixels: torch.Tensor, S: int, what: str) -> torch.Tensor:
    while pixels.dim() > 3 and pixels.shape[0] == 1:
        pixels = pixels[0]
    if tuple(pixels.shape) != (3, S, S) or not pixels.is_floating_point():
        raise ConfigError(f"{what}: pixels must be a float tensor [3, {S}, {S}] (this model's image size), "
                          f"got {pixels.dtype} {list(pixels.shape)}")
    return pixels.float()


def _preprocessor(folder: Path | None) -> dict:
    """The folder's preprocessor_config.json ({} without one)."""
    path = Path(folder) / "preprocessor_config.json" if folder is not None else None
    if path is None or not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path} is not valid JSON ({err.msg} at line {err.lineno})") from None
