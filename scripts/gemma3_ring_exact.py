"""Gemma 3 270M (--dtype gguf) past its 512-token window with its sliding layers in rings: greedy
plain decoding with every row kept (config sliding_ring=off) against plain, a suffix chain and a
draft-model tree (itself at q4_0) with rings, on a prompt of the repository's docs longer than the
window. One torch thread.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/gemma3_ring_exact.py --prompt 700 --new 96
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from outrider.catalog.resolve import resolve_model
from outrider.config import overriding
from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.sampling import SamplingParams
from outrider.weights.loader import load_decoder
from outrider.weights.tokenizer import load_tokenizer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=700)
    ap.add_argument("--new", type=int, default=96)
    args = ap.parse_args()
    torch.set_num_threads(1)
    path = resolve_model("gemma3-270m")
    model = load_decoder(path, "cpu", "gguf")
    text = (Path(__file__).parents[1] / "docs/design.md").read_text()
    ids = load_tokenizer(path)(text)["input_ids"][: args.prompt]
    request = lambda: [Request(ids, args.new, SamplingParams(0.0))]  # noqa: E731
    with overriding(sliding_ring=False):
        full = generate_ids(model, request(), set())[0].token_ids
    ring = generate_ids(model, request(), set())[0].token_ids
    print(f"prompt {len(ids)} tokens, {args.new} new; plain, rings == every row kept: {ring == full}", flush=True)
    for drafter, tree in (("suffix", "chain"), ("draft-model:gemma3-270m@q4_0", "static:2,2,1,1")):
        speculator = Speculator.build(SpecOptions(drafter, tree, "fixed:4"), model, path)
        done = generate_ids(model, request(), set(), speculation=speculator)[0]
        print(f"{drafter} {tree} with rings == plain: {done.token_ids == full}, "
              f"tau {done.stats['mean_accepted_length']:.2f}", flush=True)


if __name__ == "__main__":
    main()
