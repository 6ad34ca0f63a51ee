"""Measure a Matryoshka suite against its independently trained baselines (docs/methods.md#matryoshka).

    python scripts/matryoshka_eval.py --suite DIR --independent DIR [--prompts 8] [--new-tokens 64]

DIR from `outrider train matryoshka` (the suite) and `outrider train matryoshka --independent`
(OUT/slice-K, the baselines) with the same sizes, data and token budget. Reports, as JSON:

  - validation perplexity of every slice and every baseline (their train_info.json: the same
    held-out chunks of held-out standard-library files);
  - greedy speculative decoding of the suite's largest with each smaller slice drafting
    (`--drafter matryoshka:K`) and with each baseline of that size drafting (`draft-model:DIR`),
    and of the largest baseline with the smaller baselines drafting: tau (tokens committed per
    target forward), the drafts' acceptance rate (accepted / drafted) and the speed-up over plain
    decoding of the same target, timed in alternation (AR, method, AR, method, ...) over
    `--repeats` runs each (the median), one torch thread. Every speculative output is checked
    token for token against plain decoding (lossless).

Prompts: the first --prompt-tokens tokens of held-out code files (the training split's index % 10
== 9 files, after the ones the perplexity read), so no prompt was trained on.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--suite", required=True)
    p.add_argument("--independent", required=True)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--depth", type=int, default=4, help="draft tokens a round (chain, fixed:K)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="write the JSON here too")
    args = p.parse_args(argv)
    torch.set_num_threads(1)

    from outrider.engine.generate import generate_ids
    from outrider.engine.request import Request
    from outrider.engine.speculator import SpecOptions, Speculator
    from outrider.sampling import SamplingParams
    from outrider.train.data import Encoder, load_corpus
    from outrider.train.matryoshka import split_items
    from outrider.weights.loader import load_decoder
    from outrider.weights.tokenizer import load_tokenizer

    suite, indep = Path(args.suite), Path(args.independent)
    info = {"suite": json.loads((suite / "train_info.json").read_text()),
            "independent": json.loads((indep / "train_info.json").read_text())}
    sizes = len(info["suite"]["slices"])
    encoder = Encoder(load_tokenizer(suite), 10**9)
    _, held = split_items(load_corpus("code", regenerate=False).items)
    skip = 32  # the held-out files whose first chunk the perplexity read
    prompts = []
    for item in held[skip:]:
        ids = encoder.examples(item)[0].tokens if encoder.examples(item) else []
        if len(ids) >= args.prompt_tokens:
            prompts.append(ids[: args.prompt_tokens])
        if len(prompts) == args.prompts:
            break

    def requests():
        return [Request(list(q), args.new_tokens, SamplingParams()) for q in prompts]

    def timed(target, spec):
        began = time.perf_counter()
        out = generate_ids(target, requests(), set(), speculation=spec)
        return time.perf_counter() - began, out

    rows = []
    pairs = [("suite", suite, [f"matryoshka:{k}" for k in range(1, sizes)]
              + [f"draft-model:{indep / f'slice-{k}'}" for k in range(1, sizes)]),
             ("independent", indep / f"slice-{sizes}", [f"draft-model:{indep / f'slice-{k}'}" for k in range(1, sizes)])]
    for target_name, folder, drafters in pairs:
        target = load_decoder(folder, "cpu", torch.float32)
        _, plain = timed(target, None)  # warm: the paths are measured once
        for drafter in drafters:
            spec = Speculator.build(SpecOptions(drafter, "chain", f"fixed:{args.depth}"), target, folder)
            timed(target, spec)  # warm
            ar, sp = [], []
            for _ in range(args.repeats):
                ar.append(timed(target, None)[0])
                seconds, fast = timed(target, spec)
                sp.append(seconds)
            if [f.token_ids for f in fast] != [f.token_ids for f in plain]:
                raise SystemExit(f"{drafter} on {target_name}: not the plain greedy tokens")
            committed = sum(f.round_stats.committed for f in fast)
            rounds = sum(f.round_stats.rounds for f in fast)
            drafted = sum(f.round_stats.drafted for f in fast)
            accepted = sum(sum(f.round_stats.accepted_by_position) for f in fast)
            row = {"target": target_name, "drafter": drafter.replace(str(indep), "independent"),
                   "tau": round(committed / rounds, 3), "acceptance": round(accepted / max(1, drafted), 3),
                   "ar_s": round(statistics.median(ar), 3), "spec_s": round(statistics.median(sp), 3),
                   "speedup": round(statistics.median(ar) / statistics.median(sp), 3), "lossless": True}
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": ["python"] + sys.argv,
              "prompts": len(prompts), "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
              "depth": args.depth, "threads": 1, "torch": torch.__version__,
              "perplexity": {"suite": info["suite"]["val_perplexity"],
                             "independent": info["independent"]["val_perplexity"]},
              "tokens_per_model": {"suite": info["suite"]["tokens_per_model"],
                                   "independent": info["independent"]["tokens_per_model"]},
              "train_seconds": {"suite": info["suite"]["train_seconds"],
                                "independent": info["independent"]["train_seconds"]},
              "speculation": rows}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
