"""The C kernels' variants against each other on one model, in one process: a decode step (one token
with logits, after a prompt) and a prompt's prefill (a forward that only fills the cache), each
variant's library in turn within every round (native.use_variant), so that load from elsewhere
hits them alike; the median of the rounds, and each variant's ratio to a reference variant.

    .venv/bin/python -m outrider.kernels.variant_bench [--model smollm2-135m-instruct] [--dtype q4]
        [--threads 1] [--prompt 256] [--rounds 7] [--steps 20] [--against avx512]

A variant named `NAME:rows` runs NAME with the row kernel only (qmatmul_fill.c off: native.fill_rows_at),
so `--variants avx2:rows,avx2 --against avx2:rows` times what the fill kernel gives a prefill (the
same bits either way). Prints one line per variant: milliseconds per decode step and per prefill,
and the ratio of each to the reference (> 1: slower). The weights are loaded once (their layout is the same for every
variant; an `-i8` dtype's packed layout too, for every variant but portable, which has no int8
kernel and is refused with one).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch


def running(v: str) -> contextlib.ExitStack:
    """Within: variant NAME's library, or for NAME:rows the same with the row kernel only
    (qmatmul_fill.c off; the same bits). A one-line exit for another suffix."""
    from . import native

    stack = contextlib.ExitStack()
    name, _, path = v.partition(":")
    if path not in ("", "rows"):
        raise SystemExit(f"error: variant {v!r}: the only suffix is ':rows'")
    stack.enter_context(native.use_variant(name))
    if path == "rows":
        stack.enter_context(native.fill_rows_at(1 << 30))
    return stack


def main(argv: list[str] | None = None) -> None:
    from ..config import cpu_info, kernel_variants_here
    from ..catalog.resolve import resolve_model
    from ..models.batch import pack
    from ..weights.loader import load_decoder

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="q4")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=256, help="prompt tokens (the prefill's rows)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20, help="decode steps timed a round")
    parser.add_argument("--against", default="avx512", help="the variant the ratios are taken against")
    parser.add_argument("--variants", default=",".join(kernel_variants_here()))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    variants = [v for v in args.variants.split(",") if v]
    against = args.against if args.against in variants else variants[0]
    if args.dtype.endswith("-i8") and any(v.split(":")[0] == "portable" for v in variants):
        raise SystemExit(f"error: --dtype {args.dtype} needs an int8 kernel, which the portable variant lacks; "
                         "leave it out of --variants")

    model = load_decoder(resolve_model(args.model), "cpu", args.dtype)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(10, model.config.vocab_size - 10, (args.prompt,), generator=g)

    def prefill(cache):
        model.forward(pack([0], [0], [prompt], logits="none", scratch_row=cache.scratch_row), cache)

    def step(cache, i):
        token = torch.tensor([int(prompt[i % args.prompt])])
        return model.forward(pack([0], [args.prompt], [token], scratch_row=cache.scratch_row), cache)

    decode: dict[str, list[float]] = {v: [] for v in variants}
    fill: dict[str, list[float]] = {v: [] for v in variants}
    for v in variants:  # build, load and warm each once
        with running(v):
            cache = model.new_cache(1, args.prompt + 2)
            prefill(cache)
            step(cache, 0)
    for _ in range(args.rounds):
        for v in variants:
            with running(v):
                cache = model.new_cache(1, args.prompt + 2)
                t = time.perf_counter()
                prefill(cache)
                fill[v].append(time.perf_counter() - t)
                t = time.perf_counter()
                for i in range(args.steps):
                    step(cache, i)
                decode[v].append((time.perf_counter() - t) / args.steps)
    cpu = cpu_info()
    print(f"{cpu['model'] or cpu['machine']} ({cpu['vendor']}, family {cpu['family']}); {args.model} {args.dtype}, "
          f"{args.threads} thread(s), prompt {args.prompt}, {args.rounds} rounds x {args.steps} steps; "
          f"medians, ratio to {against}")
    ref_d, ref_f = statistics.median(decode[against]), statistics.median(fill[against])
    print(f"{'variant':16} {'decode ms':>10} {'x':>6} {'prefill ms':>11} {'x':>6}")
    for v in variants:
        d, f = statistics.median(decode[v]), statistics.median(fill[v])
        print(f"{v:16} {d * 1e3:10.2f} {d / ref_d:6.2f} {f * 1e3:11.1f} {f / ref_f:6.2f}")


if __name__ == "__main__":
    main()
