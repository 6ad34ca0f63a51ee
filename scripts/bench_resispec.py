"""ResiSpec against exact multi-draft rejection sampling on sampled siblings: later-sibling
acceptance and tau at temperatures 0.7 and 1.0 (docs/methods.md#resispec).

    python scripts/bench_resispec.py [--model smollm2-135m-instruct]
           [--drafter eagle3:smollm2-135m-instruct] [--tree sampled:3,2,1] [--depth 3]
           [--workload humaneval] [--prompts 3] [--max-new-tokens 64] [--temperatures 0.7,1.0]
           [--seed 1] [--seeds 2] [--threads 1] [--json OUT]

One process: for each temperature, the same prompts and seeds are generated with
sampled siblings (`--tree sampled:...`) verified by `multidraft_without_replacement` (exact, the
default), by `resispec-lossy`, and, for reference, a sampled chain (`rejection_chain`) of the same
depth. Every verify call is recorded: for each node the walk visits, its siblings tried in order
and which one (if any) was accepted. Reported per method: tau (committed tokens per round), the
acceptance rate of the 1st, 2nd and 3rd sibling when tried (a later sibling is tried only after
the earlier ones were rejected), the share of visited nodes where a later sibling was accepted,
and tokens per second of the whole generate call (a shared machine: read it as a rough ratio).
`bench` runs greedy only; these methods sample, so they are measured here.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter

from outrider import LLM
from outrider.bench.workloads import load_workload
from outrider.sampling import SamplingParams
from outrider.spec.tree import children


class Recorder:
    """Wraps a verifier: counts, per sibling index, how often it was tried and accepted."""

    def __init__(self, verify):
        self.verify = verify
        self.tried, self.accepted = Counter(), Counter()
        self.visits = 0  # visited nodes with at least one child
        self.later = 0  # of those, where a sibling after the first was accepted

    def __call__(self, tree, logits, params, rng):
        result = self.verify(tree, logits, params, rng)
        kids = children(tree.parents.tolist())
        node, path = 0, list(result.accepted_nodes)
        for depth in range(len(path) + 1):
            siblings = kids[node]
            if not siblings:
                break
            self.visits += 1
            taken = path[depth] if depth < len(path) else None
            last = siblings.index(taken) if taken is not None else len(siblings) - 1
            for j in range(last + 1):
                self.tried[j] += 1
            if taken is not None:
                self.accepted[last] += 1
                self.later += last >= 1
                node = taken
        return result


def run(llm: LLM, prompts, budget: int, temperature: float, seeds: list[int], chat: bool) -> tuple[dict, Recorder]:
    spec = llm.speculator
    chosen = spec.verifier_for  # the verifier the options choose, wrapped
    recorder = Recorder(chosen(SamplingParams(temperature, seed=seeds[0])))
    spec.verifier_for = lambda params, seeded=False: recorder  # named or seeded alike: the recorded one
    rounds = committed = tokens = 0
    start = time.perf_counter()
    try:
        for prompt in prompts:
            text = prompt.text if prompt.text is not None else prompt.messages[-1]["content"]
            for seed in seeds:
                out = llm.generate(text, budget, temperature=temperature, seed=seed, chat=chat)
                stats = out.stats
                rounds += stats["rounds"]
                committed += stats["mean_accepted_length"] * stats["rounds"]
                tokens += len(out.token_ids)
    finally:
        spec.verifier_for = chosen
    seconds = time.perf_counter() - start
    rates = {f"sibling_{j + 1}": (recorder.accepted[j] / recorder.tried[j] if recorder.tried[j] else None,
                                  recorder.tried[j]) for j in sorted(recorder.tried)}
    return {"tau": committed / rounds if rounds else None, "rounds": rounds, "tokens": tokens,
            "tok_s": tokens / seconds, "acceptance_when_tried": rates,
            "later_sibling_share": recorder.later / recorder.visits if recorder.visits else None}, recorder


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--drafter", default="eagle3:smollm2-135m-instruct")
    ap.add_argument("--tree", default="sampled:3,2,1")
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--workload", default="humaneval")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperatures", default="0.7,1.0")
    ap.add_argument("--seed", type=int, default=1, help="the first seed")
    ap.add_argument("--seeds", type=int, default=2, help="seeds per prompt: --seed, --seed + 1, ...")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    temperatures = [float(t) for t in args.temperatures.split(",")]
    workload = load_workload(args.workload, limit=args.prompts, max_new_tokens=args.max_new_tokens)
    controller = f"fixed:{args.depth}"
    methods = {  # name -> (tree, verifier)
        "chain (rejection_chain)": ("chain", None),
        f"{args.tree} multidraft (exact)": (args.tree, None),
        f"{args.tree} resispec-lossy": (args.tree, "resispec-lossy"),
    }
    llms = {}
    results = {"model": args.model, "drafter": args.drafter, "controller": controller, "workload": args.workload,
               "prompts": args.prompts, "max_new_tokens": args.max_new_tokens, "seed": args.seed, "seeds": args.seeds,
               "runs": []}
    for name, (tree, verifier) in methods.items():
        llms[name] = LLM(args.model, drafter=args.drafter, tree=tree, controller=controller, threads=args.threads,
                         verifier=verifier)
        llms[name].generate("Hello", 8, temperature=1.0, seed=0)  # warm up before anything is timed
    for t in temperatures:
        for name, llm in llms.items():
            seeds = list(range(args.seed, args.seed + args.seeds))
            row, _ = run(llm, workload.prompts, args.max_new_tokens, t, seeds, workload.chat)
            row.update(method=name, temperature=t)
            results["runs"].append(row)
            rates = "  ".join(f"{k} {v[0]:.3f} ({v[1]})" for k, v in row["acceptance_when_tried"].items()
                              if v[0] is not None)
            later = row["later_sibling_share"]
            print(f"T={t:<4} {name:34s} tau {row['tau']:.3f}  {row['tok_s']:6.1f} tok/s  later-sibling share "
                  f"{later if later is None else f'{later:.3f}'}  accepted when tried: {rates}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
