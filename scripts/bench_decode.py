"""Autoregressive decode speed: Outrider's runtime vs transformers' generate, same run.

Greedy, fixed number of new tokens (EOS ignored on both sides so both do the same work), on
five code prompts in completion mode. Also the memory-bandwidth floor: the bytes of weights one
token reads divided by the copy bandwidth measured in this same run.

    .venv/bin/python scripts/bench_decode.py [--model smollm2-135m-instruct] [--threads 2]
    .venv/bin/python scripts/bench_decode.py --dtype float32,q8_0,q4    # several of ours, same run

Prints a table and, with --json PATH, writes every raw figure. Speed is a ratio against the
baseline measured in the same process; absolute numbers move with the machine's load. With
several --dtype values, each prompt runs every one of ours back to back (then transformers,
float32), so load from elsewhere hits them alike; the floor is given for the first one.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

PROMPTS = [
    "def quicksort(arr):\n    \"\"\"Sort a list of numbers with quicksort.\"\"\"\n",
    "import json\n\n\ndef load_config(path):\n    \"\"\"Read a JSON config file and fill in defaults.\"\"\"\n",
    "class Stack:\n    \"\"\"A last-in first-out stack backed by a Python list.\"\"\"\n\n    def __init__(self):\n",
    "def fibonacci(n: int) -> list[int]:\n    \"\"\"Return the first n Fibonacci numbers.\"\"\"\n",
    "# Parse a CSV file and print the average of the second column\nimport csv\n\n",
]


def copy_bandwidth(megabytes: int = 512, repeats: int = 7) -> float:
    """Best-of-n copy bandwidth: bytes copied per second (each byte is read once, written once)."""
    src = torch.ones(megabytes * 2**20 // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return src.numel() * 4 / best


def read_bandwidth(megabytes: int = 512, repeats: int = 7) -> float:
    """Best-of-n read-only bandwidth (a sum over the buffer): the stricter floor for reading weights."""
    src = torch.ones(megabytes * 2**20 // 4)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        src.sum()
        best = min(best, time.perf_counter() - t)
    return src.numel() * 4 / best


def weight_bytes_per_token(decoder) -> int:
    """Bytes of weights one decode step reads: every layer, the final norm and the output head
    (a quantized weight counts the bytes its kernel keeps; the embedding rows looked up are few)."""
    def size(t) -> int:
        if t is None:
            return 0
        if isinstance(t, torch.Tensor):
            return t.numel() * t.element_size()
        return t.nbytes() if hasattr(t, "nbytes") else sum(size(p) for p in t.parts)

    total = size(decoder.lm_head) + size(decoder.norm)
    for w in decoder.layers:
        total += sum(size(t) for t in (w.input_norm, w.qkv, w.o, w.post_norm, w.gate_up, w.down))
        total += sum(size(t) for t in (w.qkv_bias, w.q_norm, w.k_norm))
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float32",
                    help="ours in these dtypes, comma-separated: float32, bfloat16, q8_0, q4")
    ap.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from outrider.engine.generate import generate_ids
    from outrider.engine.request import Request
    from outrider.catalog.resolve import resolve_model
    from outrider.weights.loader import load_decoder

    path = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(str(path))
    dtypes = args.dtype.split(",")
    floats = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    variants = {}
    for name in dtypes:
        start = time.perf_counter()
        variants[name] = load_decoder(path, "cpu", floats.get(name, name))
        print(f"loaded ours in {name} in {time.perf_counter() - start:.1f} s")
    ours = variants[dtypes[0]]
    ref = None if args.no_transformers else AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    n = args.new_tokens
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    from outrider.weights.tokenizer import eos_ids_of

    eos = eos_ids_of(path, tok)

    # warm-up every model (allocator, thread pools, lazy inits)
    for model in variants.values():
        generate_ids(model, [Request(prompts[0], 8)], eos_ids=set())
    if ref is not None:
        with torch.no_grad():
            ref.generate(torch.tensor([prompts[0]]), max_new_tokens=8, min_new_tokens=8, do_sample=False)

    rows = []
    for i, p in enumerate(prompts):
        row = {"prompt": i, "prompt_tokens": len(p)}
        outputs = {}
        for name, model in variants.items():
            t = time.perf_counter()
            outputs[name] = generate_ids(model, [Request(p, n)], eos_ids=set())[0].token_ids
            row[f"{name}_tok_s"] = len(outputs[name]) / (time.perf_counter() - t)
        out_ids = outputs[dtypes[0]]
        row.update(new_tokens=len(out_ids), ours_tok_s=row[f"{dtypes[0]}_tok_s"])
        # transformers suppresses EOS to make n tokens, we ignore it: compare up to the first EOS
        stop = min([i for i, t in enumerate(out_ids) if t in eos] + [n])
        for name in dtypes[1:]:
            row[f"{name}_same_as_{dtypes[0]}"] = outputs[name][:stop] == out_ids[:stop]
        if ref is not None:
            with torch.no_grad():
                t = time.perf_counter()
                hf = ref.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
                hf_s = time.perf_counter() - t
            hf_ids = hf[0, len(p):].tolist()
            row.update(transformers_tok_s=len(hf_ids) / hf_s, same_tokens=out_ids[:stop] == hf_ids[:stop])
        rows.append(row)
        ours_line = ", ".join(f"{name} {row[f'{name}_tok_s']:.1f}" for name in dtypes)
        hf_line = "" if ref is None else (f", transformers {row['transformers_tok_s']:.1f} tok/s, identical "
                                          f"greedy output (to the first EOS): {row['same_tokens']}")
        print(f"prompt {i}: ours {ours_line} tok/s{hf_line}")

    bandwidth = copy_bandwidth()
    reading = read_bandwidth()
    wbytes = weight_bytes_per_token(ours)
    floor_tok_s = bandwidth / wbytes
    read_floor_tok_s = reading / wbytes
    ours_tok_s = statistics.mean(r["ours_tok_s"] for r in rows)
    hf_tok_s = statistics.mean(r["transformers_tok_s"] for r in rows) if ref is not None else float("nan")
    by_dtype = {name: statistics.mean(r[f"{name}_tok_s"] for r in rows) for name in dtypes}
    summary = {
        "model": args.model, "threads": args.threads, "new_tokens": n, "dtype": dtypes[0],
        "tok_s_by_dtype": by_dtype,
        "weight_bytes_by_dtype": {name: weight_bytes_per_token(m) for name, m in variants.items()},
        "ours_tok_s": ours_tok_s, "transformers_tok_s": hf_tok_s, "speedup_vs_transformers": ours_tok_s / hf_tok_s,
        "weight_bytes_per_token": wbytes, "copy_bandwidth_gb_s": bandwidth / 1e9,
        "floor_tok_s": floor_tok_s, "fraction_of_floor": ours_tok_s / floor_tok_s,
        "read_bandwidth_gb_s": reading / 1e9, "read_floor_tok_s": read_floor_tok_s,
        "fraction_of_read_floor": ours_tok_s / read_floor_tok_s,
        "all_identical": all(r.get("same_tokens", False) for r in rows),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "machine": platform.processor() or platform.machine(),
    }
    if len(dtypes) > 1:
        for name in dtypes:
            print(f"ours in {name}: {by_dtype[name]:.1f} tok/s ({by_dtype[name] / by_dtype[dtypes[0]]:.2f}x "
                  f"{dtypes[0]}), {summary['weight_bytes_by_dtype'][name] / 1e6:.0f} MB of weights a token")
    print(f"\nours {ours_tok_s:.1f} tok/s | transformers {hf_tok_s:.1f} tok/s | "
          f"speed-up {summary['speedup_vs_transformers']:.2f}x")
    print(f"weights read per token {wbytes / 1e6:.0f} MB | copy bandwidth {bandwidth / 1e9:.1f} GB/s | "
          f"floor {floor_tok_s:.1f} tok/s | ours at {100 * summary['fraction_of_floor']:.0f}% of the floor")
    print(f"read-only bandwidth {reading / 1e9:.1f} GB/s | read floor {read_floor_tok_s:.1f} tok/s | ours at "
          f"{100 * summary['fraction_of_read_floor']:.0f}% of it")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
