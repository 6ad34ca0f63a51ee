"""Tool calls under a grammar, with and without grammar-aware drafting (issue 25 item 3).

    python scripts/bench_structured.py --prompts 8 --drafters suffix,ngram,eagle3:smollm2-135m-instruct

The toolcall workload (BFCL v4 questions with their function schemas, chat mode), each answer
constrained to one call of one of its functions ({"name", "arguments"}: spec/grammar.py
tool_call_schema). For autoregressive decoding and each drafter: the lossless check (every
speculative output equals the autoregressive one under the same grammar), how many outputs
ended (rather than meet --max-new-tokens) and parse, tau, decode-only tokens per second
(prefill excluded), and the same with grammar-aware drafting off (the grammar then only masks
the target's logits). Methods run back to back on each prompt, rounds alternated, in one
process; figures are ratios to autoregressive decoding.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--drafters", default="suffix,ngram,eagle3:smollm2-135m-instruct")
    parser.add_argument("--controller", default="fixed:4")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2, help="passes over the prompts (the first warms the suffix trees)")
    args = parser.parse_args()

    import torch

    from outrider import LLM
    from outrider.bench.workloads import TOOLCALL_SYSTEM, load_workload
    from outrider.engine.generate import generate_ids
    from outrider.engine.request import Request
    from outrider.engine.speculator import SpecOptions, Speculator
    from outrider.spec.grammar import tool_call_schema

    torch.set_num_threads(args.threads)
    llm = LLM(args.model, threads=args.threads)
    compiler = llm.grammars()
    workload = load_workload("toolcall", limit=args.prompts)
    prompts = workload.prompts[: args.prompts]
    jobs = []
    before, after = (part.format() for part in TOOLCALL_SYSTEM.split("{functions}"))
    for p in prompts:
        # the functions block of the system message (after the entry's own system text, if any)
        system = p.messages[0]["content"]
        block = system[system.index(before) + len(before):system.rindex(after)]
        functions = json.loads("[" + block.replace("\n", ",") + "]")
        grammar = compiler.json_schema(tool_call_schema(functions), strict=False)  # closed per function
        text = llm.tokenizer.apply_chat_template(p.messages, add_generation_prompt=True, tokenize=False)
        jobs.append((p.id, llm.tokenizer(text, add_special_tokens=False)["input_ids"], grammar))
    methods = {"autoregressive": (None, True)}
    for name in args.drafters.split(","):  # a drafter of its own each: suffix pools learn from their outputs
        options = SpecOptions(name, "chain", args.controller).check()
        methods[name] = (Speculator.build(options, llm.target, llm.path), True)
        methods[f"{name} (grammar-unaware)"] = (Speculator.build(options, llm.target, llm.path), False)
    figures = {m: {"tokens": 0, "decode_s": 0.0, "rounds": 0, "parsed": 0, "ended": 0, "equal": 0} for m in methods}
    reference = {}
    for rep in range(args.repeats):
        for pid, ids, grammar in jobs:
            order = list(methods) if rep % 2 == 0 else list(reversed(methods))
            for m in order:
                spec, aware = methods[m]
                done = generate_ids(llm.target, [Request(ids, args.max_new_tokens, grammar=grammar,
                                                         grammar_drafting=aware)], llm.eos_ids, speculation=spec)[0]
                if m == "autoregressive" and rep == 0:
                    reference[pid] = done.token_ids
                if rep == args.repeats - 1:  # the last pass is measured
                    f = figures[m]
                    f["tokens"] += len(done.token_ids)
                    f["decode_s"] += done.stats["total_s"] - done.stats["prefill_s"]
                    f["rounds"] += done.stats["rounds"]
                    f["ended"] += done.finish_reason == "eos"
                    try:
                        json.loads(llm.decode(done.token_ids))
                        f["parsed"] += 1
                    except ValueError:
                        pass
                    f["equal"] += done.token_ids == reference[pid]
    base = figures["autoregressive"]["tokens"] / figures["autoregressive"]["decode_s"]
    print(f"{args.model}, {len(jobs)} toolcall prompts, {args.max_new_tokens} new tokens at most, "
          f"{args.controller}, {args.threads} threads, {time.strftime('%Y-%m-%d')}")
    print(f"{'method':44s} {'lossless':>9s} {'ended':>7s} {'parses':>7s} {'tau':>5s} {'decode tok/s':>13s} "
          f"{'vs AR':>6s}")
    for m, f in figures.items():
        speed = f["tokens"] / f["decode_s"]
        print(f"{m:44s} {f['equal']:>4d}/{len(jobs):<4d} {f['ended']:>3d}/{len(jobs):<3d} "
              f"{f['parsed']:>3d}/{len(jobs):<3d} "
              f"{f['tokens'] / max(f['rounds'], 1):5.2f} {speed:13.1f} {speed / base:6.2f}")
    return 0 if all(f["equal"] == len(jobs) for f in figures.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
