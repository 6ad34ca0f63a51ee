"""How close a distilled hybrid is to its base model, both run by Outrider's runtime (float32):
perplexity on held-out text and greedy agreement.

    .venv/bin/python scripts/hybrid_quality.py --hybrid smollm2-135m-gdn --base smollm2-135m-instruct

- perplexity: `--windows` windows of `--seq-len` tokens from the held-out stdlib files
  (train/distill_hybrid.py `split_files`: never trained on), one per file, seeded;
- greedy agreement over the first `--prompts` HumanEval prompts, `--new` tokens each: the mean
  first position where the hybrid's greedy continuation leaves the base's (`--new` when it never
  does), the share of positions equal, and the hybrid's top-1 agreement with the base's greedy
  tokens when fed them (teacher-forced: one disagreement does not end the count).
Prints one JSON object (and writes it to --out if given).
"""

from __future__ import annotations

import argparse
import json
import math
import sysconfig
import time
from pathlib import Path

import torch

from outrider.bench.datasets import humaneval
from outrider.catalog.resolve import resolve_model
from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.models.batch import pack
from outrider.sampling import SamplingParams
from outrider.train.distill_hybrid import split_files, windows
from outrider.weights.loader import load_decoder
from outrider.weights.tokenizer import load_tokenizer


def logits_of(model, tokens: torch.Tensor) -> torch.Tensor:
    """tokens [T] -> logits [T, vocab], one prefill from an empty cache."""
    cache = model.new_cache(1, tokens.shape[0] + 1)
    return model.forward(pack([0], [0], [tokens], scratch_row=cache.scratch_row), cache).logits[0].float()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hybrid", default="smollm2-135m-gdn")
    ap.add_argument("--base", default="smollm2-135m-instruct")
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    start = time.time()
    base_dir, hybrid_dir = resolve_model(args.base), resolve_model(args.hybrid)
    tokenizer = load_tokenizer(base_dir)
    models = {"base": load_decoder(base_dir, "cpu", torch.float32), "hybrid": load_decoder(hybrid_dir, "cpu", torch.float32)}
    _, held = split_files(Path(sysconfig.get_paths()["stdlib"]))
    data = windows(held, tokenizer, args.windows, args.seq_len, args.seed)
    result = {"held_out_windows": f"{args.windows} x {args.seq_len} tokens from {len(held)} held-out stdlib files"}
    with torch.no_grad():
        for name, model in models.items():
            nll = [torch.nn.functional.cross_entropy(logits_of(model, w)[:-1], w[1:]) for w in data]
            result[f"ppl_{name}"] = round(math.exp(float(torch.stack(nll).mean())), 3)
        prompts = [tokenizer(p["prompt"], add_special_tokens=False)["input_ids"] for p in humaneval()[:args.prompts]]
        requests = [Request(p, args.new, SamplingParams(0.0)) for p in prompts]
        outs = {name: [c.token_ids for c in generate_ids(m, requests, set())] for name, m in models.items()}
        first, equal, forced, total = [], 0, 0, 0
        for prompt, b, h in zip(prompts, outs["base"], outs["hybrid"]):
            n = min(len(b), len(h))
            diverge = next((i for i in range(n) if b[i] != h[i]), n)
            first.append(diverge)
            equal += sum(int(x == y) for x, y in zip(b, h))
            logits = logits_of(models["hybrid"], torch.tensor(prompt + b))
            guess = logits[len(prompt) - 1:-1].argmax(-1)
            forced += int((guess == torch.tensor(b)).sum())
            total += len(b)
    result.update({"prompts": f"the first {args.prompts} HumanEval prompts, {args.new} greedy tokens",
                   "mean_first_divergence": round(sum(first) / len(first), 2), "first_divergence": first,
                   "greedy_equal_share": round(equal / total, 4), "teacher_forced_top1": round(forced / total, 4),
                   "seconds": round(time.time() - start, 1)})
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
