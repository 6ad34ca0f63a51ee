"""A prompt's prefill, ours against llama.cpp on the same GGUF and against torch's float32 GEMM on the
same shapes, in one process, rounds alternating the candidates (a burst of load elsewhere hits
them all), the best round of each counting.

    .venv/bin/python scripts/bench_prefill.py [--model smollm2-135m-instruct] [--dtype q4]
        [--threads 1] [--prompt 512] [--rounds 5] [--variants avx2:rows,avx2] [--llama]

Candidates:
- ours: the model's forward over the whole prompt, filling the cache (no logits), in each kernel
  variant given (`NAME:rows`: the row kernel only, qmatmul_fill.c off: the same bits, for A/B);
- llama.cpp (`--llama`, llama-cpp-python from the `peers` extra, or any build on PYTHONPATH): the
  same prompt's evaluation on the model's original GGUF, in one batch: its own C-side timer
  (llama_perf_context's t_p_eval_ms) where it reports one, else the one call's wall time (the
  binding adds about a millisecond to a call of seconds; llama-cpp-python 0.3.16 reports 0);
- torch float32: F.linear over the prompt's rows with float32 weights of every projection's
  shape (the layers' products only: the GEMM rate the issue's goal names), reported as GFLOP/s
  beside ours over the same products.
The prompt is random token ids (a prefill's cost does not depend on them). Printed: milliseconds
and prompt tokens a second for each, and the ratios.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="q4")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--variants", default="", help="kernel variants (NAME or NAME:rows), default: the CPU's best")
    parser.add_argument("--llama", action="store_true", help="time llama.cpp on the model's original GGUF too")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from outrider.catalog.resolve import resolve_model
    from outrider.config import cpu_info, kernel_variants_here
    from outrider.kernels import native
    from outrider.kernels.variant_bench import running
    from outrider.models.batch import pack
    from outrider.weights.loader import load_decoder

    folder = resolve_model(args.model)
    model = load_decoder(folder, "cpu", args.dtype)
    variants = [v for v in args.variants.split(",") if v] or [kernel_variants_here()[0]]
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(10, model.config.vocab_size - 10, (args.prompt,), generator=g)

    def ours(v: str) -> float:
        with running(v):
            cache = model.new_cache(1, args.prompt + 2)
            start = time.perf_counter()
            model.forward(pack([0], [0], [prompt], logits="none", scratch_row=cache.scratch_row), cache)
            return time.perf_counter() - start

    # the layers' projections (a stack of parts of different kinds: each part), as the kernel reads
    # them, and as float32 weights of the same shapes for torch's GEMM
    projections = [p for layer in model.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)
                   for p in getattr(w, "parts", [w])]
    weights = [p.state["weight"] for p in projections]
    shapes = [w.shape for w in weights]
    floats = {shape: torch.randn(*shape, generator=g) * 0.02 for shape in set(shapes)}
    xs = {shape[1]: torch.randn(args.prompt, shape[1], generator=g) for shape in shapes}
    flops = sum(2 * args.prompt * out * inn for out, inn in shapes)

    def gemm() -> float:
        start = time.perf_counter()
        for shape in shapes:
            F.linear(xs[shape[1]], floats[shape])
        return time.perf_counter() - start

    def products(v: str) -> float:  # ours over the same products (the layers' weights themselves)
        with running(v):
            start = time.perf_counter()
            for w in weights:
                native.qmatmul(xs[w.shape[1]], w)
            return time.perf_counter() - start

    candidates = {f"ours {v}": (lambda v=v: ours(v)) for v in variants}
    candidates.update({f"ours {v} products": (lambda v=v: products(v)) for v in variants})
    candidates["torch float32 GEMM products"] = gemm
    if args.llama:
        import llama_cpp

        llm = llama_cpp.Llama(model_path=str(folder / "original.gguf"), n_ctx=args.prompt + 16, n_batch=args.prompt,
                              n_ubatch=args.prompt, n_threads=args.threads, n_threads_batch=args.threads, verbose=False)
        ids = [int(t) for t in prompt]

        def llama() -> float:
            llm.reset()
            llama_cpp.llama_perf_context_reset(llm.ctx)
            start = time.perf_counter()
            llm.eval(ids)  # one batch of the whole prompt: one call into the library
            wall = time.perf_counter() - start
            own = llama_cpp.llama_perf_context(llm.ctx).t_p_eval_ms / 1e3
            return own if own > 0 else wall  # llama-cpp-python 0.3.16 reports 0 here: its call's wall time

        candidates["llama.cpp"] = llama
        print(llama_cpp.llama_print_system_info().decode().strip())
    best = {name: float("inf") for name in candidates}
    for name, run in candidates.items():  # warm: build, load, first touch
        run()
    for _ in range(args.rounds):
        for name, run in candidates.items():
            best[name] = min(best[name], run())
    cpu = cpu_info()
    print(f"{cpu['model'] or cpu['machine']} ({cpu['vendor']}, family {cpu['family']}); {args.model} {args.dtype}, "
          f"{args.threads} thread(s), prompt {args.prompt} tokens, best of {args.rounds} rounds")
    for name, seconds in best.items():
        rate = (f"{flops / seconds / 1e9:7.1f} GFLOP/s" if "products" in name
                else f"{args.prompt / seconds:7.1f} tok/s")
        print(f"{name:36} {seconds * 1e3:9.1f} ms  {rate}")
    if args.llama:
        for v in variants:
            print(f"ours {v} / llama.cpp prompt tokens a second: {best['llama.cpp'] / best[f'ours {v}']:.2f}x")
    for v in variants:
        print(f"ours {v} products / torch float32 GEMM rate: {best['torch float32 GEMM products'] / best[f'ours {v} products']:.2f}x")


if __name__ == "__main__":
    main()
