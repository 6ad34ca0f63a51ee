"""OoO-Spec's hint, counted: how late it comes and what it adds, request by request.

    .venv/bin/python scripts/ooo_hints.py [--target qwen2.5-coder-1.5b-instruct]
        [--sidecar qwen2.5-coder-0.5b-instruct] [--dtype gguf-i8] [--prompts 3] [--new-tokens 96]
        [--threads 1] [--wait]

Runs the `toolcall` workload's first prompts one after another through `generate_ids` with
`--drafter ooo:SIDECAR` (fixed:6), as the bench does, and prints the drafter's own counters
(`OooDrafter.stats()`: hints made and ready, each hint's latency from the request's start, tree
nodes drafted from hints and tokens accepted from them beyond the suffix tree) beside each
request's time and tokens and its autoregressive time. `--wait` makes each request wait for its hint before the first round
(what an instant sidecar would give: the hint's worth without its latency). Every output is
checked against autoregressive decoding.
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--sidecar", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--dtype", default=None, help="the target's dtype (default: its own)")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--wait", action="store_true", help="each request waits for its hint")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from outrider.bench.run import encode_prompt
    from outrider.bench.workloads import load_workload
    from outrider.catalog.resolve import resolve_model
    from outrider.engine.generate import generate_ids
    from outrider.engine.request import Request
    from outrider.engine.speculator import SpecOptions, Speculator
    from outrider.sampling import SamplingParams
    from outrider.weights.loader import load_decoder
    from outrider.weights.tokenizer import eos_ids_of

    folder = resolve_model(args.target)
    target = load_decoder(folder, "cpu", args.dtype)
    tok = AutoTokenizer.from_pretrained(folder)
    eos = set(eos_ids_of(folder, tok))
    workload = load_workload("toolcall", limit=args.prompts, max_new_tokens=args.new_tokens)
    spec = Speculator.build(SpecOptions(f"ooo:{args.sidecar}", "chain", "fixed:6"), target, folder)
    spec.drafter.wait = args.wait
    for prompt in workload.prompts:
        ids = encode_prompt(tok, workload, prompt)
        request = Request(list(ids), args.new_tokens, SamplingParams(0.0))
        start = time.perf_counter()
        plain = generate_ids(target, [request], eos)[0].token_ids
        ar_seconds = time.perf_counter() - start
        start = time.perf_counter()
        done = generate_ids(target, [request], eos, speculation=spec)[0]
        seconds = time.perf_counter() - start
        print(f"{prompt.id}: {len(ids)} prompt tokens, {len(done.token_ids)} new in {seconds:.2f} s "
              f"(autoregressive {ar_seconds:.2f} s), equal to autoregressive: {done.token_ids == plain}", flush=True)
    stats = spec.drafter.stats()
    print({k: ([round(x, 2) for x in v] if isinstance(v, list) else v) for k, v in stats.items()})


if __name__ == "__main__":
    main()
