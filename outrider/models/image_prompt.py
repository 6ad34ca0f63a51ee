"""A prompt with images, for a vision-language model (models/idefics3.py): the prompt's `<image>`
markers placed (where the prompt puts them, else where the chat template does), each expanded into
the tokens Idefics3's / SmolVLM's processor writes for it, and the image rows that replace its
image tokens (`Request.prompt_embeds`). The pixels: models/image_pixels.py.

An image not split becomes `<fake_token_around_image><global-img>` + K x `<image>` +
`<fake_token_around_image>`, K = the rows a tile gives (VisionConfig.rows_per_image); an image
split into rows x cols tiles becomes, row by row, `<fake_token_around_image><row_i_col_j>` + K x
`<image>` for each tile, a newline after each row, then a newline and the whole image's tokens as
above. The i-th image token of the prompt gets the i-th row of the images' tiles in order.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from .image_pixels import ImagePixels
from .vision_encoder import VisionConfig

IMAGE, AROUND, GLOBAL = "<image>", "<fake_token_around_image>", "<global-img>"


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


def image_string(image: ImagePixels, rows_per_tile: int) -> str:
    """The text an image's `<image>` marker becomes (the processor's)."""
    whole = AROUND + GLOBAL + IMAGE * rows_per_tile + AROUND
    if not image.rows:
        return whole
    grid = "".join("".join(f"{AROUND}<row_{r + 1}_col_{c + 1}>" + IMAGE * rows_per_tile for c in range(image.cols))
                   + "\n" for r in range(image.rows))
    return grid + "\n" + whole


def expand_text(text: str, images: list[ImagePixels], vision: VisionConfig, tokenizer) -> str:
    """`text` with its i-th `<image>` marker replaced by image i's tokens (image_string)."""
    for name in (AROUND, GLOBAL, IMAGE):
        tid = tokenizer.convert_tokens_to_ids(name)
        if tid is None or tid == tokenizer.unk_token_id:
            raise ConfigError(f"the tokenizer has no {name} token: not an Idefics3 / SmolVLM tokenizer")
    parts = text.split(IMAGE)
    if len(parts) != len(images) + 1:
        raise ConfigError(f"the prompt has {len(parts) - 1} {IMAGE} markers for {len(images)} image(s)")
    out = parts[0]
    for image, part in zip(images, parts[1:]):
        out += image_string(image, vision.rows_per_image) + part
    return out


def expand(ids: list[int], vision: VisionConfig, tokenizer) -> list[int]:
    """Token ids with each image token (one an image, not split) expanded: around, global, K image
    tokens, around (what expand_text gives, for a caller with ids)."""
    around, glob = (tokenizer.convert_tokens_to_ids(t) for t in (AROUND, GLOBAL))
    out = []
    for t in ids:
        out += [around, glob, *[t] * vision.rows_per_image, around] if t == vision.image_token_id else [t]
    return out


def prompt_embeds(tower, ids: list[int], pixels: list) -> tuple[torch.Tensor, torch.Tensor]:
    """The image rows of a prompt whose image tokens are expanded: (positions long [N K], rows
    [N K, E]) for its N tiles (pixels: one [3, S, S] or [M, 3, S, S] a image, in order); the i-th
    image token of the prompt gets the i-th row."""
    c = tower.config
    tiles = [p.tiles if isinstance(p, ImagePixels) else p if p.dim() == 4 else p[None] for p in pixels]
    count = sum(t.shape[0] for t in tiles)
    positions = torch.tensor([p for p, t in enumerate(ids) if t == c.image_token_id], dtype=torch.long)
    want = count * c.rows_per_image
    if positions.numel() != want:
        raise ConfigError(f"the prompt has {positions.numel()} image tokens for {len(pixels)} image(s) of "
                          f"{count} tile(s) and {c.rows_per_image} rows a tile ({want})")
    if positions.numel() and int(positions[-1]) >= len(ids) - 1:
        raise ConfigError("the prompt ends with an image token: its last token must be text")
    if not count:
        return positions, torch.zeros(0, c.text_hidden_size)
    rows = tower.features(torch.cat(tiles))  # [M, K, E]
    return positions, rows.reshape(-1, rows.shape[-1])
