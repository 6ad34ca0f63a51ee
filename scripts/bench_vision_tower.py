"""The image side's cost a prompt pays once a tile (models/vision_encoder.py), at a real VLM's sizes
with random weights (no checkpoint is downloaded): the vision encoder and connector on N tiles, in
thread CPU seconds.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_vision_tower.py --tiles 1 --repeats 3

Defaults are SmolVLM-256M's sizes as we know its published config.json (not read from a file): vision 768 wide, 12 layers, 12 heads, MLP 3072,
512 x 512 tiles of 16-pixel patches, scale factor 4 (64 image tokens a tile), text hidden 576.
"""

from __future__ import annotations

import argparse
import time

import torch

from outrider.models.vision_encoder import VisionConfig, VisionLayer, VisionTower


def random_tower(c: VisionConfig, seed: int = 0) -> VisionTower:
    g = torch.Generator().manual_seed(seed)
    C, F, r = c.hidden_size, c.intermediate_size, c.scale_factor

    def w(*shape):
        return torch.randn(*shape, generator=g) * shape[-1] ** -0.5

    def norm():
        return torch.ones(C), torch.zeros(C)

    layers = [VisionLayer(norm(), w(3 * C, C), torch.zeros(3 * C), w(C, C), torch.zeros(C), norm(), w(F, C),
                          torch.zeros(F), w(C, F), torch.zeros(C)) for _ in range(c.num_layers)]
    return VisionTower(c, w(C, 3, c.patch_size, c.patch_size), torch.zeros(C), w(c.patches_per_side ** 2, C),
                       layers, norm(), w(c.text_hidden_size, C * r * r))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiles", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--image-size", type=int, default=512)
    p.add_argument("--patch", type=int, default=16)
    p.add_argument("--scale", type=int, default=4)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    c = VisionConfig(hidden_size=768, intermediate_size=3072, num_layers=12, num_heads=12,
                     image_size=args.image_size, patch_size=args.patch, num_channels=3, layer_norm_eps=1e-6,
                     scale_factor=args.scale, image_token_id=0, text_hidden_size=576)
    tower = random_tower(c)
    pixels = torch.randn(args.tiles, 3, c.image_size, c.image_size)
    times = []
    for _ in range(args.repeats):
        start = time.thread_time()
        rows = tower.features(pixels)  # [N, K, E]
        times.append(time.thread_time() - start)
    print(f"vision tower: {args.tiles} tile(s) of {c.image_size} x {c.image_size} -> {tuple(rows.shape)} image rows; "
          f"thread CPU s, {args.threads} thread(s): min {min(times):.3f}, all {[round(t, 3) for t in times]}")


if __name__ == "__main__":
    main()
