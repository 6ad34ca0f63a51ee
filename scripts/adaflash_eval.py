"""Measure AdaFlash's two parts on the bench's three workloads (docs/methods.md#adaflash).

    python scripts/adaflash_eval.py --drafter NAME=SPEC [--drafter ...] [--prompts 4] [--new-tokens 64]

Each --drafter is a label and a `--drafter` spec (e.g. `sft=dflash:smollm2-135m-instruct`,
`opd+len=adaflash:out/opd-len`, `cut1=dflash:smollm2-135m-instruct@1`), run greedily as a chain under
`fixed:K` (K = --depth, default the block's 7, or the spec's own @K) on SmolLM2-135M-Instruct over the first --prompts prompts of humaneval, toolcall and
code-edit (bench/workloads.py, the bench's own prompt encoding). Per drafter and workload: tau
(tokens committed per target forward) as the mean over prompts and its variance over prompts;
across the three workloads the mean of the workload means and their variance (the card's "tau
variance across domains"); drafted (= verified) tokens a round; the drafts' acceptance rate; and
the wall time against plain decoding run in alternation (median of --repeats). Every output is
checked token for token against plain greedy decoding (lossless), else it exits non-zero.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

WORKLOADS = ("humaneval", "toolcall", "code-edit")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--drafter", action="append", required=True, metavar="LABEL=SPEC")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--depth", type=int, default=7)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)

    from outrider.bench.run import encode_prompt
    from outrider.bench.workloads import load_workload
    from outrider.catalog.resolve import resolve_model
    from outrider.engine.generate import generate_ids
    from outrider.engine.request import Request
    from outrider.engine.speculator import SpecOptions, Speculator
    from outrider.sampling import SamplingParams
    from outrider.weights.loader import load_decoder
    from outrider.weights.tokenizer import eos_ids_of, load_tokenizer

    path = resolve_model(args.model)
    target = load_decoder(path, "cpu", torch.float32)
    tok = load_tokenizer(path)
    eos = set(eos_ids_of(path, tok))
    prompts = {}
    for name in WORKLOADS:
        w = load_workload(name, limit=args.prompts, max_new_tokens=args.new_tokens)
        prompts[name] = [encode_prompt(tok, w, q) for q in w.prompts]

    def run(ids, spec):
        began = time.perf_counter()
        out = generate_ids(target, [Request(list(ids), args.new_tokens, SamplingParams())], eos, speculation=spec)
        return time.perf_counter() - began, out[0]

    specs = []
    for item in args.drafter:
        label, _, spec = item.partition("=")
        spec, _, depth = spec.partition("@")  # SPEC@K: this drafter's own fixed:K
        controller = f"fixed:{depth or args.depth}"
        specs.append((label, Speculator.build(SpecOptions(spec, "chain", controller), target, path),
                      f"{spec} {controller}"))
    rows = []
    for name in WORKLOADS:
        for ids in prompts[name]:
            run(ids, None)  # warm
            plain = [run(ids, None) for _ in range(args.repeats)]
            for label, spec, text in specs:
                runs = [run(ids, spec) for _ in range(args.repeats)]
                out = runs[-1][1]
                if out.token_ids != plain[-1][1].token_ids:
                    raise SystemExit(f"{label} on {name}: not the plain greedy tokens")
                s = out.round_stats
                rows.append({"workload": name, "drafter": label, "tau": s.committed / max(1, s.rounds),
                             "rounds": s.rounds, "drafted": s.drafted, "accepted": sum(s.accepted_by_position),
                             "spec_s": statistics.median(r[0] for r in runs),
                             "ar_s": statistics.median(r[0] for r in plain)})
    summary = {}
    for label, _, text in specs:
        mine = [r for r in rows if r["drafter"] == label]
        per = {}
        for name in WORKLOADS:
            these = [r for r in mine if r["workload"] == name]
            taus = [r["tau"] for r in these]
            per[name] = {"tau_mean": round(statistics.mean(taus), 3),
                         "tau_var_prompts": round(statistics.pvariance(taus), 3),
                         "verified_per_round": round(sum(r["drafted"] for r in these)
                                                     / max(1, sum(r["rounds"] for r in these)), 3),
                         "acceptance": round(sum(r["accepted"] for r in these)
                                             / max(1, sum(r["drafted"] for r in these)), 3),
                         "speedup": round(sum(r["ar_s"] for r in these) / sum(r["spec_s"] for r in these), 3)}
        means = [per[n]["tau_mean"] for n in WORKLOADS]
        summary[label] = {"spec": text, "workloads": per, "tau_mean": round(statistics.mean(means), 3),
                          "tau_var_workloads": round(statistics.pvariance(means), 4),
                          "verified_per_round": round(sum(r["drafted"] for r in mine)
                                                      / max(1, sum(r["rounds"] for r in mine)), 3),
                          "speedup": round(sum(r["ar_s"] for r in mine) / sum(r["spec_s"] for r in mine), 3),
                          "lossless": True}
        print(json.dumps({label: summary[label]}), file=sys.stderr, flush=True)
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": ["python"] + sys.argv,
              "model": args.model, "prompts_per_workload": args.prompts, "new_tokens": args.new_tokens,
              "depth": args.depth, "threads": 1, "torch": torch.__version__, "summary": summary, "rows": rows}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
