"""The cost of a k-token verify forward against a 1-token one, where its time goes, and our
autoregressive speed against transformers' generate, in one run.

    .venv/bin/python scripts/bench_verify_cost.py [--model smollm2-135m-instruct] [--dtype float32,q8_0,q4]
    .venv/bin/python scripts/bench_verify_cost.py --linear auto,linear,mm_t,packed   # A/B of the CPU paths
    .venv/bin/python scripts/bench_verify_cost.py --profile 1,4,8,16 --no-generate  # the per-op table
    .venv/bin/python scripts/bench_verify_cost.py --variant avx2 --dtype q4,q4-i8     # another kernel variant
    .venv/bin/python scripts/bench_verify_cost.py --linear auto+rows,auto              # without / with qmatmul_fill.c

cost(k) is the median time of a forward over k new tokens (a chain, as control/profile.py
measures it) after a `--context`-token prompt; printed as cost(k)/cost(1) for k = 1, 2, 4, 8, 16.
Every variant (dtype x linear path) runs each k in turn within one repetition, so load from
elsewhere hits them alike; the load average is printed before and after. The per-op table
(torch.profiler, the first variant with --linear auto, else the first) gives the time inside our layer functions (linear, attention,
rotary, norms; "rest" is everything else: K/V writes, residual adds, the MLP's gate, masks) and the
top aten ops by self time. For a model whose products all run in the native kernel, the products'
compute floor: their multiply-adds at the kernel's own rate with the weights in cache (each weight
shape timed on a ~1 MB slice, its fastest call), over cost(1): where it passes 1, compute and not memory traffic
bounds cost(k)/cost(1) on this machine. Then our greedy autoregressive tok/s against transformers' greedy
generate on one prompt, same new tokens, alternated (EOS ignored on both sides).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import time

import torch

KS = (1, 2, 4, 8, 16)
SCOPES = ("linear", "attention", "apply_rotary", "rotary_tables", "rms_norm", "embedding")
PROMPT = "def quicksort(arr):\n    \"\"\"Sort a list of numbers with quicksort.\"\"\"\n"


@contextlib.contextmanager
def linear_path(path: str):
    """Force one CPU linear path (cpu_linear.py) for the block; "auto" = the measured choice. A
    path ending in "+rows" (e.g. auto+rows) also keeps the native products on the row kernel
    (qmatmul_fill.c off: the same bits; an A/B of what the fill kernel gives a verify)."""
    from outrider.config import overriding
    from outrider.kernels import native

    base, _, rows = path.partition("+")
    with overriding(linear=base), native.fill_rows_at(1 << 30 if rows == "rows" else 0):
        yield


def verify_batches(model, context: int):
    """A cache holding a `context`-token prompt and one chain batch per k after it."""
    from outrider.models.batch import pack

    cache = model.new_cache(1, context + max(KS) + 1)
    prefix = torch.randint(0, model.config.vocab_size, (context,), generator=torch.Generator().manual_seed(0))
    model.forward(pack([0], [0], [prefix], logits="none", scratch_row=cache.scratch_row), cache)
    batches = {k: pack([0], [context], [prefix[:k]], [torch.tensor([-1, *range(k - 1)])],
                       scratch_row=cache.scratch_row) for k in KS}
    return cache, batches


def measure_costs(variants: dict, context: int, repeats: int) -> dict:
    """variant name -> {k: [seconds, ...]}, every variant and k interleaved per repetition."""
    setups = {name: (model, path, *verify_batches(model, context)) for name, (model, path) in variants.items()}
    times = {name: {k: [] for k in KS} for name in variants}
    for rep in range(repeats + 1):  # the first is warm-up
        for name, (model, path, cache, batches) in setups.items():
            with linear_path(path):
                for k in KS:
                    start = time.perf_counter()
                    model.forward(batches[k], cache)
                    if rep:
                        times[name][k].append(time.perf_counter() - start)
    return times


def native_matrices(model) -> list:
    """The model's NativeWeights (every layer's products and the head), or [] when any product
    does not run in the native kernel (a float model)."""
    from outrider.kernels.decoder_layer import NATIVE_KERNELS

    mats = [m for w in model.layers for m in (w.qkv, w.o, w.gate_up, w.down)] + [model.lm_head]
    parts = [p for m in mats for p in getattr(m, "parts", [m])]
    if not all(getattr(p, "kernel", None) in NATIVE_KERNELS for p in parts):
        return []
    return [p.state["weight"] for p in parts]


def first_rows(w, n: int):
    """The NativeWeight of w's first n output rows (the same bytes: views)."""
    from outrider.kernels.native import NativeWeight

    if w.lanes:  # whole records a row, the scales among them; d only says their dtype
        return NativeWeight(w.kind, (n, w.shape[1]), w.q[:n], w.d, None, lanes=True)
    d = w.d[:n]
    m = d if w.m is w.d else (None if w.m is None else w.m[:n])  # FACTORED q4_1: its mins are in d
    return NativeWeight(w.kind, (n, w.shape[1]), w.q[:n], d, m)


def compute_floor(model, ks=KS, cache_bytes: int = 1 << 20, calls: int = 60) -> dict:
    """k -> seconds the forward's matrix products take at k rows when the weights need not be
    read from memory: each distinct (kind, in) shape's kernel timed at k rows on the first rows
    of one of its weights (about `cache_bytes` of them: the cores' L2), the fastest of `calls`
    calls, its multiply-adds a second applied to every weight of that shape. A lower bound on a
    k-token forward beside the memory one (its weights read once): where it exceeds cost(1),
    compute, not memory traffic, sets cost(k)/cost(1)."""
    from outrider.kernels.native import qmatmul

    weights = native_matrices(model)
    if not weights:
        return {}
    shapes = {}
    for w in weights:
        shapes.setdefault((w.code, w.shape[1]), []).append(w)
    floor = {k: 0.0 for k in ks}
    for (_, K), group in shapes.items():
        w = group[0]
        row = sum(t[0].numel() * t.element_size() for t in w.tensors())  # bytes of one output row
        n = min(w.shape[0], max(16, cache_bytes // max(row, 1) // 16 * 16))
        part = first_rows(w, n)
        macs = sum(g.shape[0] for g in group) * K
        for k in ks:
            x = torch.randn(k, K)
            qmatmul(x, part)
            fastest = float("inf")
            for _ in range(calls):
                start = time.perf_counter()
                qmatmul(x, part)
                fastest = min(fastest, time.perf_counter() - start)
            floor[k] += fastest * macs / (n * K)  # the slice's rate, for all of the shape's rows
    return floor


def int8_peak(threads: int, rounds: int = 20_000_000) -> float:
    """The CPU's int8 multiply-adds a second on `threads` threads with the kernel variant's own
    instructions, nothing loaded (outrider_i8_peak: independent vpdpbusd in qmatmul_i8.c, vpmaddubsw
    + vpaddw in qmatmul_i8_avx2.c), the fastest of 3; 0.0 without an int8 kernel (portable)."""
    from outrider.kernels import native

    if not native.i8_available():
        return 0.0
    fastest = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        native.library().outrider_i8_peak(rounds, threads)
        fastest = min(fastest, time.perf_counter() - start)
    return rounds * 24 * 64 * threads / fastest


def native_variant() -> str | None:
    from outrider.kernels import native

    return native.variant()


def report_floors(variants: dict, times: dict, summary: dict, threads: int) -> float | None:
    """Print each native variant's compute floor over its cost(1) and, for the int8 kernel, its
    in-cache rate as a share of the CPU's peak (into `summary` too); the peak, or None."""
    floors = {}
    for name, (model, _) in variants.items():  # the linear paths do not change a native model's products
        floor = compute_floor(model) if all(m is not model for m, _ in floors.values()) else {}
        if floor:
            floors[name] = (model, floor)
    if not floors:
        return None
    print("\nthe products' compute floor (their multiply-adds at the kernel's in-cache rate, weights"
          " not read from memory) over cost(1): cost(k)/cost(1) cannot go below it where it passes 1")
    lanes = {}
    for name, (model, floor) in floors.items():
        one = statistics.median(times[name][1])
        weights = native_matrices(model)
        macs = sum(w.shape[0] * w.shape[1] for w in weights)
        summary[name]["compute_floor_ms"] = {k: 1e3 * t for k, t in floor.items()}
        summary[name]["in_cache_gmacs"] = {k: k * macs / floor[k] / 1e9 for k in KS}
        if any(w.lanes for w in weights):
            lanes[name] = summary[name]["in_cache_gmacs"]
        print(f"  {name:24s} " + "  ".join(f"k={k}: {floor[k] / one:.2f}" for k in KS) +
              f"   (products alone at k=1: {1e3 * floor[1]:.1f} ms in cache)", flush=True)
    if not lanes:
        return None
    peak = int8_peak(threads)
    from outrider.kernels import native

    how = ("vpdpbusd" if "vnni" in (native_variant() or "") or native_variant() == "amx" else
           "AVX-VNNI vpdpbusd" if native.i8_avx_vnni() else "vpmaddubsw + vpaddw")
    print(f"\nthe CPU's int8 peak ({threads} threads, {how} alone): {peak / 1e9:.0f} G multiply-adds/s;"
          " the products in cache at k rows, G multiply-adds/s (share of that peak):")
    for name, rates in lanes.items():
        print(f"  {name:24s} " + "  ".join(f"k={k}: {rates[k]:.0f} ({1e9 * rates[k] / peak:.0%})" for k in KS))
    return peak


def per_op_profile(model, path: str, context: int, ks: list[int], top: int) -> dict:
    """torch.profiler over 5 forwards at each k: our layer functions (inclusive) and top aten ops."""
    import outrider.models.decoder as decoder
    import outrider.models.layers as layers
    from torch.profiler import ProfilerActivity, profile, record_function

    def scoped(name, fn):
        def run(*args, **kwargs):
            with record_function(f"outrider::{name}"):
                return fn(*args, **kwargs)
        return run

    saved = {(mod, name): getattr(mod, name) for mod in (decoder, layers) for name in SCOPES if hasattr(mod, name)}
    tables = {}
    cache, batches = verify_batches(model, context)
    try:
        for (mod, name), fn in saved.items():
            setattr(mod, name, scoped(name, fn))
        with linear_path(path):
            for k in ks:
                batch = batches.get(k) or verify_batches(model, context)[1][k]
                model.forward(batch, cache)
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    for _ in range(5):
                        with record_function("outrider::forward"):
                            model.forward(batch, cache)
                events = prof.key_averages()
                ours = {e.key.split("::")[1]: e.cpu_time_total / 5e3 for e in events if e.key.startswith("outrider::")}
                aten = sorted((e for e in events if not e.key.startswith("outrider::")),
                              key=lambda e: -e.self_cpu_time_total)[:top]
                tables[k] = {"ours_ms": ours, "top_self_ms": [(e.key, e.self_cpu_time_total / 5e3, e.count // 5)
                                                             for e in aten]}
    finally:
        for (mod, name), fn in saved.items():
            setattr(mod, name, fn)
    return tables


def ar_vs_transformers(variants: dict, path, tok, new_tokens: int, rounds: int) -> dict:
    """tok/s of our greedy AR (each variant) and of transformers' greedy generate, alternated."""
    from transformers import AutoModelForCausalLM

    from outrider.engine.generate import generate_ids
    from outrider.engine.request import Request

    ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = tok(PROMPT)["input_ids"]
    speeds = {name: [] for name in variants} | {"transformers": []}
    for rep in range(rounds + 1):  # the first is warm-up
        for name, (model, linear) in variants.items():
            with linear_path(linear):
                start = time.perf_counter()
                out = generate_ids(model, [Request(ids, new_tokens)], eos_ids=set())[0].token_ids
                if rep:
                    speeds[name].append(len(out) / (time.perf_counter() - start))
        with torch.no_grad():
            start = time.perf_counter()
            hf = ref.generate(torch.tensor([ids]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False)
            if rep:
                speeds["transformers"].append((hf.shape[1] - len(ids)) / (time.perf_counter() - start))
    return {name: statistics.median(v) for name, v in speeds.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32", help="comma-separated: float32, q8_0, q4 (and the bf16 ones)")
    ap.add_argument("--linear", default="auto", help="CPU linear paths, comma-separated: auto, linear, mm_t, packed")
    ap.add_argument("--kv-dtype", default="float32", help="the K/V cache's values, comma-separated: float32, float16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variant", default=None, help="the native kernels' variant (config kernel_variant): auto, "
                    "amx, avx512-vnni, avx512, avx2, portable; default: the config's")
    ap.add_argument("--no-avx-vnni", action="store_true", help="the AVX2 int8 kernel's sums with vpmaddubsw even "
                    "where the CPU has AVX-VNNI (as on an AVX2 CPU without it)")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--profile", default="", help="k values for the per-op table, e.g. 1,4,8,16")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--no-generate", action="store_true", help="skip the AR vs transformers comparison")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer

    from outrider.kernels import cpu_linear
    from outrider.catalog.resolve import resolve_model
    from outrider.weights.loader import load_decoder

    path = resolve_model(args.model)
    from outrider.errors import OutriderError
    from outrider.weights.loader import parse_dtype, parse_kv_dtype

    try:  # a wrong name: one line naming the choices, before any model loads
        if args.variant:
            from outrider.config import use

            use(kernel_variant=args.variant)  # refused in one line where this CPU cannot run it
        dtypes = {name: parse_dtype(name) for name in args.dtype.split(",")}
        kv_dtypes = {name: parse_kv_dtype(name) for name in args.kv_dtype.split(",")}
    except OutriderError as err:
        raise SystemExit(f"error: {err}")
    load_before = os.getloadavg()
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus, torch {torch.__version__} "
          f"({torch.backends.cpu.get_cpu_capability()}), {args.threads} threads, load average "
          f"{load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}", flush=True)
    from outrider.kernels import native

    if args.no_avx_vnni:
        native.i8_avx_vnni(False)
    print(native.describe(), flush=True)
    models = {}
    for name, dtype in dtypes.items():
        for kv_name, kv in kv_dtypes.items():  # a model each: the cache's dtype is the model's kv_dtype
            model = models[name if len(kv_dtypes) == 1 else f"{name} kv {kv_name}"] = load_decoder(path, "cpu", dtype)
            model.kv_dtype = kv
    variants = {f"{name}/{linear}": (model, linear) for name, model in models.items()
                for linear in args.linear.split(",")}
    times = measure_costs(variants, args.context, args.repeats)
    print(f"\ncost(k)/cost(1), median of {args.repeats}, context {args.context} (cost(1) in ms):")
    summary = {}
    for name, by_k in times.items():
        med = {k: statistics.median(v) for k, v in by_k.items()}
        summary[name] = {"cost_ms": {k: 1e3 * t for k, t in med.items()},
                         "ratio": {k: t / med[1] for k, t in med.items()}}
        print(f"  {name:24s} cost(1) {1e3 * med[1]:7.1f}  " + "  ".join(f"k={k}: {med[k] / med[1]:.2f}" for k in KS),
              flush=True)
    peak = report_floors(variants, times, summary, args.threads)
    chosen = {f"{o}x{i} {str(dtype).replace('torch.', '')}": paths
              for (o, i, dtype), paths in cpu_linear.choices().items()}
    print("\nCPU linear paths chosen (rows 1 | 2-4 | 5-16 | more):")
    for shape, paths in chosen.items():
        print(f"  {shape}: {' | '.join(paths)}")
    result = {"costs": summary, "linear_paths": chosen, "load_before": load_before, "int8_peak_macs": peak}
    if args.profile:
        first = next((name for name, (_, linear) in variants.items() if linear == "auto"), next(iter(variants)))
        ks = [int(k) for k in args.profile.split(",")]
        tables = per_op_profile(*variants[first], args.context, ks, args.top)
        print(f"\nper-op profile of {first} (ms per forward, torch.profiler adds overhead):")
        for k, table in tables.items():
            ours = table["ours_ms"]
            total = ours.pop("forward", float("nan"))
            rest = total - sum(ours.values())
            parts = "  ".join(f"{name} {ms:.1f}" for name, ms in sorted(ours.items(), key=lambda kv: -kv[1]))
            print(f"  k={k}: forward {total:.1f} = {parts}  rest {rest:.1f}")
            print("      top self: " + ", ".join(f"{key} {ms:.2f} (x{n})" for key, ms, n in table["top_self_ms"]))
        result["profile"] = tables
    if not args.no_generate:
        tok = AutoTokenizer.from_pretrained(str(path))
        speeds = ar_vs_transformers(variants, path, tok, args.new_tokens, rounds=2)
        print(f"\ngreedy AR, {args.new_tokens} new tokens, median of 2 (tok/s):")
        for name, s in speeds.items():
            print(f"  {name:24s} {s:6.1f}" + ("" if name == "transformers" else
                                             f"  = {s / speeds['transformers']:.2f}x transformers"))
        result["ar_tok_s"] = speeds
    load_after = os.getloadavg()
    result["load_after"] = load_after
    print(f"\nload average after: {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=str)


if __name__ == "__main__":
    main()
