"""Speculative decoding vs autoregressive decoding on HumanEval prompts, one run, greedy.

    .venv/bin/python scripts/bench_spec.py --pair smol      # SmolLM2-135M: ngram, suffix, early exit
    .venv/bin/python scripts/bench_spec.py --pair qwen      # Qwen2.5-Coder 1.5B target, 0.5B draft
    .venv/bin/python scripts/bench_spec.py --pair gemma     # Gemma 3 270M (gguf): lookups, early exit, itself@q4_0

Each prompt runs every method back to back (interleaved, so slow drifts of the machine hit all
methods alike); speed-ups are ratios of total tokens/s within this run. Every speculative output
is checked token for token against our autoregressive output (the lossless audit).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys

import torch

PAIRS = {
    "smol": {
        "target": "smollm2-135m-instruct",
        "methods": ["ngram|chain|fixed:4", "suffix|chain|fixed:6", "early-exit:8|chain|fixed:3",
                    "ngram|chain|adaptive", "suffix|chain|cost"],
        "peers": [],
    },
    "qwen": {
        "target": "qwen2.5-coder-1.5b-instruct",
        "methods": ["draft-model:qwen2.5-coder-0.5b-instruct|chain|fixed:5",
                    "draft-model:qwen2.5-coder-0.5b-instruct|static:2,2,1,1|fixed:4",
                    "draft-model:qwen2.5-coder-0.5b-instruct|chain|cost"],
        "peers": ["transformers-assisted"],
    },
    "gemma": {  # Gemma 3 270M on its own Q4_K_M blocks (no smaller Gemma 3 to draft with: lookups and
        "target": "gemma3-270m",  # itself at q4_0; early-exit:9 accepts almost nothing on it)
        "dtype": "gguf",
        "methods": ["suffix|chain|fixed:4", "ngram|chain|fixed:4",
                    "draft-model:gemma3-270m@q4_0|chain|fixed:4"],
        "peers": [],
    },
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pair", choices=sorted(PAIRS), default="smol")
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from outrider.bench.datasets import humaneval
    from outrider.bench.runner import aggregate, first_difference, run_ours, run_transformers
    from outrider.catalog.resolve import resolve_model
    from outrider.weights.loader import load_decoder
    from outrider.engine.speculator import SpecOptions, Speculator

    pair = PAIRS[args.pair]
    path = resolve_model(pair["target"])
    tok = AutoTokenizer.from_pretrained(str(path))
    target = load_decoder(path, "cpu", pair.get("dtype", torch.float32))
    prompts = [tok(p["prompt"])["input_ids"] for p in humaneval()[: args.prompts]]
    specs = {}
    for m in pair["methods"]:
        drafter, tree, controller = m.split("|")
        specs[m] = Speculator.build(SpecOptions(drafter, tree, controller), target, path, log=print)
    peers = {}
    if "transformers-assisted" in pair["peers"]:
        ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        draft_path = resolve_model("qwen2.5-coder-0.5b-instruct")
        assistant = AutoModelForCausalLM.from_pretrained(str(draft_path), dtype=torch.float32).eval()
        peers["transformers-assisted"] = lambda ids: run_transformers(ref, ids, args.new_tokens, assistant=assistant)

    run_ours(target, None, prompts[0][:16], 4)  # warm-up
    runs: dict[str, list] = {"autoregressive": [], **{m: [] for m in specs}, **{p: [] for p in peers}}
    audit = []
    for i, ids in enumerate(prompts):
        base = run_ours(target, None, ids, args.new_tokens)
        runs["autoregressive"].append(base)
        line = [f"prompt {i}: ar {len(base.output_ids) / base.seconds:.1f} tok/s"]
        for m, spec in specs.items():
            r = run_ours(target, spec, ids, args.new_tokens)
            runs[m].append(r)
            diff = first_difference(base.output_ids, r.output_ids)
            if diff is not None:
                audit.append({"method": m, "prompt": i, "first_difference": diff})
            line.append(f"{m.split('|')[0].split(':')[0]} {len(r.output_ids) / r.seconds:.1f}")
        for p, fn in peers.items():
            r = fn(ids)
            runs[p].append(r)
            line.append(f"{p} {len(r.output_ids) / r.seconds:.1f}")
        print(" | ".join(line), flush=True)

    table = {name: aggregate(rs) for name, rs in runs.items()}
    base_tps = table["autoregressive"]["tokens_per_s"]
    print(f"\n{'method':58s} {'tok/s':>7s} {'speed-up':>8s} {'tau':>5s}  acceptance by position")
    for name, t in table.items():
        t["speedup"] = t["tokens_per_s"] / base_tps
        acc = " ".join(f"{a:.2f}" for a in t.get("acceptance_by_position", []))
        tau = f"{t['mean_accepted_length']:.2f}" if "mean_accepted_length" in t else "-"
        print(f"{name:58s} {t['tokens_per_s']:7.2f} {t['speedup']:7.2f}x {tau:>5s}  {acc}")
    if "transformers-assisted" in table:
        for name in specs:
            table[name]["speedup_vs_transformers_assisted"] = (
                table[name]["tokens_per_s"] / table["transformers-assisted"]["tokens_per_s"])
            print(f"{name}: {table[name]['speedup_vs_transformers_assisted']:.2f}x transformers' assisted generation")
    print("lossless audit:", "all outputs identical" if not audit else f"MISMATCHES {audit}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"pair": args.pair, "target": pair["target"], "prompts": args.prompts,
                       "new_tokens": args.new_tokens, "threads": args.threads, "table": table, "audit": audit,
                       "torch": torch.__version__, "machine": platform.processor() or platform.machine()},
                      f, indent=2)
    sys.exit(1 if audit else 0)


if __name__ == "__main__":
    main()
