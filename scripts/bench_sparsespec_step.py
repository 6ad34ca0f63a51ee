"""SparseSpec-L's draft cost against a dense decode step, interleaved in one process (docs/methods.md#sparsespec-l).

For each context length: prefill a long prompt (scripts/long_prompts.py's first module) into the
target's cache, verify a 5-token chain once (its scores and its taps: what the two selection paths
read), then time, in turn and `--repeats` times (medians printed):

    dense       one decode step of the target (1 token, full attention): autoregressive decoding's step
    verify      the 5-token verify forward: plain; with the scores option (the fast path's verify);
                with every layer's hidden state tapped (the slow path's: one native call a layer)
    select      the selection alone: from the verify's scores (native: a top-k per layer and head),
                or from the taps (torch: queries recomputed, q.k over every layer's keys)
    gather      the kept rows copied into the drafter's cache
    sparse1/4   a SparseSpec proposal of 1 and of 4 drafts (selection + gather + forwards), fast path

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
    from outrider.spec.types import Budget
    from outrider.drafters.sparsespec import QUERY_ROWS, SparseDrafter, parse_argument
    from outrider.models.batch import pack
    from outrider.spec.shapes import parse_shape
    from outrider.weights.loader import auto_dtype, load_decoder

    path = resolve_model(args.model)
    target = load_decoder(path, "cpu", auto_dtype(path, "cpu"))  # the packaged dtype (Q4: the native layer), as the bench
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    text = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text() * 3
    layers = tuple(range(target.config.num_layers))
    sparsity = parse_argument(args.budget)
    for n in args.tokens:
        prompt = tok.encode(text).ids[:n]
        cache = target.new_cache(1, n + 16)
        with torch.inference_mode():
            for at in range(0, n - 5, 512):  # all but the last 5 tokens: those are the verified chain
                part = prompt[at : min(at + 512, n - 5)]
                target.forward(pack([0], [at], [torch.tensor(part)], logits="none", scratch_row=cache.scratch_row),
                               cache)

        def verify(attention=False, taps=()):
            with torch.inference_mode():
                return target.forward(pack([0], [n - 5], [torch.tensor(prompt[-5:])], logits="real", hidden_layers=taps,
                                           scratch_row=cache.scratch_row), cache, attention=attention)

        out = verify(True, layers)
        scores = out.attention[0]  # [layers, G, n]: the 5 rows' weights
        hidden = torch.stack([out.hidden[layer][0, -QUERY_ROWS:] for layer in layers], dim=1)  # [4, layers, E]
        cache.set_length(0, n - 1)
        drafters = {}
        for name, native in (("native", True), ("torch", False)):
            d = SparseDrafter(target, parse_shape("chain"), sparsity, native_scores=native)
            d.attach_target_cache(cache)
            d.start(0, prompt, target_slot=0, hidden=hidden)
            d.observe_attention([0], [scores])
            drafters[name] = d
        fast, slow = drafters["native"], drafters["torch"]
        kept = fast._select(0, n - 1)

        def dense():
            with torch.inference_mode():
                target.forward(pack([0], [n - 1], [torch.tensor(prompt[-1:])], logits="last",
                                    scratch_row=cache.scratch_row), cache)

        def sparse(k):
            return lambda: fast.propose(0, prompt, Budget(k, k))

        runs = {"dense": dense, "verify": lambda: verify(), "verify+scores": lambda: verify(True),
                "verify+taps": lambda: verify(False, layers), "select native": lambda: fast._select(0, n - 1),
                "select torch": lambda: slow._select(0, n - 1),
                "gather": lambda: fast._gather(0, fast._states[0].slot, kept),
                "sparse1": sparse(1), "sparse4": sparse(4)}
        times = {name: [] for name in runs}
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
              f"per-round selection+gather {med['sparse1'] - step:.1f} ms (native scores); "
              + "; ".join(f"{k} {med[k]:.1f}" for k in runs if k != "dense")
              + f" ms (medians of {args.repeats})", flush=True)


if __name__ == "__main__":
    main()
