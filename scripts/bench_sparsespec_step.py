"""SparseSpec-L's draft cost against a dense decode step, interleaved in one process (docs/methods.md#sparsespec-l).

For each context length: prefill a long prompt (scripts/long_prompts.py's first module) into the
target's cache, then time, in turn and `--repeats` times (medians printed):

    dense     one decode step of the target (1 token, full attention): autoregressive decoding's step
    sparse1   a SparseSpec proposal of 1 draft: selection (q.k over every layer's keys) + gather + 1 forward
    sparse4   the same with 4 drafts (3 more forwards over the kept keys)

so a sparse draft step is (sparse4 - sparse1) / 3 and the per-round fixed part sparse1 - step.

    .venv/bin/python scripts/bench_sparsespec_step.py --tokens 2000 4000 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import sysconfig
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tokens", type=int, nargs="+", default=[2000, 4000])
    ap.add_argument("--budget", default="256,4,32", help="sparsespec's BUDGET,SINK,RECENT")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from tokenizers import Tokenizer

    from outrider.catalog.resolve import resolve_model
    from outrider.drafters.base import Budget
    from outrider.drafters.sparsespec import SparseDrafter, parse_argument
    from outrider.models.batch import pack
    from outrider.spec.shapes import parse_shape
    from outrider.weights.loader import load_decoder

    path = resolve_model(args.model)
    target = load_decoder(path, "cpu")
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    text = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text() * 3
    layers = tuple(range(target.config.num_layers))
    sparsity = parse_argument(args.budget)
    for n in args.tokens:
        prompt = tok.encode(text).ids[:n]
        cache = target.new_cache(1, n + 16)
        hidden = None
        with torch.inference_mode():
            for at in range(0, n - 1, 512):
                part = prompt[at : min(at + 512, n - 1)]
                last = at + 512 >= n - 1
                out = target.forward(pack([0], [at], [torch.tensor(part)], logits="none",
                                          hidden_layers=layers if last else (), scratch_row=cache.scratch_row), cache)
                if last:
                    hidden = torch.stack([out.hidden[layer][0, -4:] for layer in layers], dim=1)
        cache.set_length(0, n - 1)
        drafter = SparseDrafter(target, parse_shape("chain"), sparsity)
        drafter.attach_target_cache(cache)
        drafter.start(0, prompt, target_slot=0, hidden=hidden)

        def dense():
            with torch.inference_mode():
                target.forward(pack([0], [n - 1], [torch.tensor(prompt[-1:])], logits="last",
                                    scratch_row=cache.scratch_row), cache)

        def sparse(k):
            return lambda: drafter.propose(0, prompt, Budget(k, k))

        times = {"dense": [], "sparse1": [], "sparse4": []}
        runs = {"dense": dense, "sparse1": sparse(1), "sparse4": sparse(4)}
        for fn in runs.values():
            fn()  # warm
        for _ in range(args.repeats):
            for name, fn in runs.items():
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        step = (med["sparse4"] - med["sparse1"]) / 3
        print(f"context {n}: kept {sparsity.budget}/{n - 1} keys a layer and head ({sparsity.budget / (n - 1):.1%}); "
              f"dense step {med['dense']:.1f} ms; sparse draft step {step:.1f} ms ({step / med['dense']:.2f}x); "
              f"per-round selection+gather {med['sparse1'] - step:.1f} ms; sparse1 {med['sparse1']:.1f}, "
              f"sparse4 {med['sparse4']:.1f} ms (medians of {args.repeats})", flush=True)


if __name__ == "__main__":
    main()
