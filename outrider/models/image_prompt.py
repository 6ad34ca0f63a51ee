"""A prompt with images, for a vision-language model (models/idefics3.py): pixels read and
preprocessed, the prompt's `<image>` markers expanded into the image tokens the model replaces,
and the image rows that replace them (`Request.prompt_embeds`).

An image is a file: PNG / JPEG / anything Pillow reads (when Pillow is installed), preprocessed as
Idefics3's image processor does an image it does not split, with the folder's
preprocessor_config.json: the longest edge resized to size.longest_edge, then to the vision
encoder's S x S (Lanczos both), scaled by rescale_factor, normalized by image_mean / image_std
(S, 1/255, 0.5, 0.5 without the file); splitting into tiles is not supported (docs/models.md). Or
a pixel tensor already preprocessed as transformers' processor gives `pixel_values`: a .npy file
or a .safetensors file holding one tensor (`pixel_values` if several), [3, S, S] (or
[1, 3, S, S], [1, 1, 3, S, S]); or such a tensor in Python.

Each `<image>` in the prompt becomes, as Idefics3's and SmolVLM's processors write an image that
is not split: `<fake_token_around_image><global-img>` + K x `<image>` + `<fake_token_around_image>`,
K = the rows an image gives (VisionConfig.rows_per_image).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import ConfigError
from .vision_encoder import VisionConfig

IMAGE, AROUND, GLOBAL = "<image>", "<fake_token_around_image>", "<global-img>"
TENSOR_FILES = (".npy", ".safetensors")


def read_pixels(image, vision: VisionConfig, folder: Path | None = None) -> torch.Tensor:
    """One image (a path, or a pixel tensor) -> normalized pixels [3, S, S] float32."""
    S = vision.image_size
    if isinstance(image, torch.Tensor):
        return _checked(image, S, "the image tensor")
    path = Path(image)
    if not path.is_file():
        raise ConfigError(f"image '{image}': no such file")
    if path.suffix.lower() == ".npy":
        import numpy as np

        try:
            array = np.load(path, allow_pickle=False)
        except (ValueError, OSError) as err:
            raise ConfigError(f"image '{image}' is not a readable .npy array ({err})") from None
        return _checked(torch.from_numpy(array), S, f"image '{image}'")
    if path.suffix.lower() == ".safetensors":
        return _checked(_safetensors_pixels(path), S, f"image '{image}'")
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise ConfigError(f"image '{image}': reading image files needs Pillow (pip install pillow); or give the "
                          "pixels as a .npy / .safetensors tensor [3, S, S]") from None
    raw = _preprocessor(folder)
    try:
        with Image.open(path) as img:
            rgb = img.convert("RGB")
            rgb = rgb.resize(longest_edge_size(rgb.width, rgb.height, (raw.get("size") or {}).get("longest_edge") or S),
                             Image.Resampling.LANCZOS)
            rgb = rgb.resize((S, S), Image.Resampling.LANCZOS)  # the unsplit image: S x S
    except (UnidentifiedImageError, OSError) as err:
        raise ConfigError(f"image '{image}' is not an image Pillow can read ({type(err).__name__})") from None
    import numpy as np

    pixels = torch.from_numpy(np.asarray(rgb, dtype=np.float32).copy()).permute(2, 0, 1)  # [3, S, S], 0..255
    mean = torch.tensor(raw.get("image_mean") or [0.5] * 3, dtype=torch.float32)
    std = torch.tensor(raw.get("image_std") or [0.5] * 3, dtype=torch.float32)
    scale = float(raw.get("rescale_factor") or 1 / 255)
    return (pixels * scale - mean.view(3, 1, 1)) / std.view(3, 1, 1)


def longest_edge_size(width: int, height: int, longest: int, cap: int = 4096) -> tuple[int, int]:
    """(width, height) with the longest edge `longest` and the aspect kept, the other edge rounded
    down then up to even, at most `cap` (the Idefics3 processor's first resize, `size.longest_edge`)."""
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


def image_text(prompt: str, count: int, chat: bool, tokenizer) -> str:
    """The prompt's text with one `<image>` an image: where the prompt puts them, else before its
    text; with chat, the chat template puts them (content items {"type": "image"}, as SmolVLM's
    template takes them; a template of plain-text content gets the markers in the text)."""
    given = prompt.count(IMAGE)
    if given not in (0, count):
        raise ConfigError(f"the prompt has {given} {IMAGE} markers for {count} image(s): put one per image, or none")
    text = prompt if given else IMAGE * count + prompt
    if not chat:
        return text
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("this model has no chat template; run without --chat")
    if not given:
        content = [{"type": "image"}] * count + [{"type": "text", "text": prompt}]
        try:
            out = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                                tokenize=False)
            if out.count(IMAGE) == count:
                return out
        except Exception:  # a template that takes only text content: the markers go in the text
            pass
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=False)


def expand(ids: list[int], vision: VisionConfig, tokenizer) -> list[int]:
    """Each image token of `ids` (one an image) -> around, global, K image tokens, around."""
    around, glob = (tokenizer.convert_tokens_to_ids(t) for t in (AROUND, GLOBAL))
    unknown = tokenizer.unk_token_id
    for name, tid in ((AROUND, around), (GLOBAL, glob)):
        if tid is None or tid == unknown:
            raise ConfigError(f"the tokenizer has no {name} token: not an Idefics3 / SmolVLM tokenizer")
    out = []
    for t in ids:
        out += [around, glob, *[t] * vision.rows_per_image, around] if t == vision.image_token_id else [t]
    return out


def prompt_embeds(tower, ids: list[int], pixels: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The image rows of a prompt whose image tokens are expanded: (positions long [N K], rows
    [N K, E]); the i-th image token of the prompt gets the i-th row, images in order."""
    c = tower.config
    positions = torch.tensor([p for p, t in enumerate(ids) if t == c.image_token_id], dtype=torch.long)
    want = len(pixels) * c.rows_per_image
    if positions.numel() != want:
        raise ConfigError(f"the prompt has {positions.numel()} image tokens for {len(pixels)} image(s) of "
                          f"{c.rows_per_image} rows each ({want})")
    if positions.numel() and int(positions[-1]) >= len(ids) - 1:
        raise ConfigError("the prompt ends with an image token: its last token must be text")
    if not pixels:
        return positions, torch.zeros(0, c.text_hidden_size)
    rows = tower.features(torch.stack(pixels))  # [N, K, E]
    return positions, rows.reshape(-1, rows.shape[-1])
