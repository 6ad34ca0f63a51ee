"""Oilbird's counters per lexical base: how often the base missed and the semantic key had the token.

    .venv/bin/python scripts/oilbird_counters.py [--model smollm2-135m-instruct] [--dtype gguf-i8]
        [--workload toolcall --workload jsonl:/tmp/multiturn.jsonl] [--prompts 3] [--new-tokens 96]
        [--threads 1] [--bases suffix,ngram,suffix:local]

Runs each workload's first prompts one after another through `generate_ids` with
`--drafter oilbird:base=BASE` (fixed:6), one speculator per workload and base, as the bench builds
them, and prints per base tau (committed tokens per round, as the bench reports it) and the
drafter's own counters (`OilbirdDrafter.stats()`): rounds, rounds where the base's tree lacked the
target's token within the depth (`base_misses`), of those the ones the semantic lookup had
proposed (`semantic_present`, `missed_present_share`), nodes drafted from the semantic trie alone,
tokens accepted beyond the base's tree, the pool held. Greedy: the taus equal the bench's.
Used for docs/methods.md#oilbird.
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default=None, help="the target's dtype (default: its own)")
    parser.add_argument("--workload", action="append", default=None)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--bases", default="suffix,ngram,suffix:local")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from outrider.bench.run import encode_prompt
    from outrider.bench.workloads import load_workload
    from outrider.catalog.resolve import resolve_model
    from outrider.engine.generate import generate_ids
    from outrider.engine.request import Request
    from outrider.engine.speculator import SpecOptions, Speculator
    from outrider.weights.loader import load_decoder
    from outrider.weights.tokenizer import eos_ids_of

    folder = resolve_model(args.model)
    target = load_decoder(folder, "cpu", args.dtype)
    tok = AutoTokenizer.from_pretrained(str(folder))
    eos = set(eos_ids_of(folder, tok))
    for name in args.workload or ["toolcall"]:
        workload = load_workload(name, limit=args.prompts, max_new_tokens=args.new_tokens)
        ids = [encode_prompt(tok, workload, prompt) for prompt in workload.prompts]
        for base in args.bases.split(","):
            drafter = "oilbird" if base == "suffix" else f"oilbird:base={base}"
            spec = Speculator.build(SpecOptions(drafter, "chain", "fixed:6"), target, folder)
            rounds = committed = 0
            with torch.inference_mode():
                for prompt_ids, prompt in zip(ids, workload.prompts):
                    done = generate_ids(target, [Request(list(prompt_ids), workload.budget(prompt))], eos,
                                        speculation=spec)[0]
                    rounds += done.stats["rounds"]
                    committed += done.stats["committed"]
            stats = spec.drafter.stats()
            shown = {k: round(v, 3) if isinstance(v, float) else v for k, v in stats.items()}
            print(f"{name} | {drafter}: tau {committed / max(rounds, 1):.2f} | {shown}", flush=True)


if __name__ == "__main__":
    main()
