"""AngelSpec's batch-level verification allocation against uniform depth, with several requests in one engine.

    OMP_NUM_THREADS=1 python scripts/bench_batch_verify.py --drafter dflash:smollm2-135m-instruct,vocab=8192 \
        --depth 4 --workload humaneval --prompts 4 --budget 6 --repeats 2

Arms (each one `LLM.generate` of all the prompts at once, so every round verifies them together):
AR; `fixed:K` (every request drafts and verifies K deep); `batch-verify:K` (drafts K deep, the
round's verify allocated best first across requests by the measured cost model); and
`batch-verify:K,budget=N` per --budget (a hard shared budget of N drafted nodes a round). Per arm:
wall seconds, tokens/s, speed-up over AR, tau (committed tokens / rounds), drafted and verified
nodes, and whether every output equals AR's (they must: the allocation is lossless). The arms run
in a rotated order per repeat (the machine may be shared). One thread.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def render(tokenizer, prompt) -> str:
    if prompt.text is not None:
        return prompt.text
    return tokenizer.apply_chat_template(prompt.messages, tokenize=False, add_generation_prompt=True)


def run_arm(model, drafter, controller, prompts, max_new_tokens, tree):
    from outrider.llm import LLM

    llm = LLM(model, drafter=drafter, controller=controller, tree=tree, threads=1, prefix_cache_mb=0) if drafter \
        else LLM(model, threads=1, prefix_cache_mb=0)
    llm.generate(prompts[0][:64], 4)  # warm the kernels and caches
    began = time.perf_counter()
    out = llm.generate(prompts, max_new_tokens)
    seconds = time.perf_counter() - began
    tokens = sum(len(c.token_ids) for c in out)
    rounds = sum(c.round_stats.rounds for c in out)
    committed = sum(c.round_stats.committed for c in out)
    c = getattr(llm.speculator, "controller", None) if drafter else None
    return {"seconds": seconds, "tokens": tokens, "tau": committed / max(rounds, 1), "rounds": rounds,
            "drafted": getattr(c, "drafted", None), "verified": getattr(c, "verified", None),
            "outputs": [list(x.token_ids) for x in out]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--drafter", required=True)
    p.add_argument("--tree", default="chain")
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--budget", type=int, action="append", default=[], help="a batch-verify arm with budget=N")
    p.add_argument("--workload", default="humaneval")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    from outrider.bench.workloads import load_workload
    from outrider.catalog.resolve import resolve_model
    from outrider.weights.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model(a.model))
    prompts = [render(tokenizer, q) for q in load_workload(a.workload, limit=a.prompts).prompts]
    arms = [("ar", None, None), (f"fixed:{a.depth}", a.drafter, f"fixed:{a.depth}"),
            (f"batch-verify:{a.depth}", a.drafter, f"batch-verify:{a.depth}")]
    arms += [(f"batch-verify:{a.depth},budget={n}", a.drafter, f"batch-verify:{a.depth},budget={n}") for n in a.budget]
    results: dict[str, list[dict]] = {name: [] for name, _, _ in arms}
    for r in range(a.repeats):
        order = arms[r % len(arms):] + arms[: r % len(arms)]
        for name, drafter, controller in order:
            results[name].append(run_arm(a.model, drafter, controller, prompts, a.max_new_tokens, a.tree))
            print(f"repeat {r} {name}: {results[name][-1]['seconds']:.2f} s", file=sys.stderr)
    reference = results["ar"][0]["outputs"]
    ar_s = sum(x["seconds"] for x in results["ar"]) / len(results["ar"])
    table = []
    for name, runs in results.items():
        s = sum(x["seconds"] for x in runs) / len(runs)
        row = {"arm": name, "seconds": round(s, 3), "tok_s": round(runs[0]["tokens"] / s, 2),
               "speedup": round(ar_s / s, 3), "tau": round(runs[0]["tau"], 3), "drafted": runs[0]["drafted"],
               "verified": runs[0]["verified"], "equal_to_ar": all(x["outputs"] == reference for x in runs)}
        table.append(row)
        print(json.dumps(row))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"argv": sys.argv, "rows": table}, f, indent=1)
    return 0 if all(row["equal_to_ar"] for row in table) else 1


if __name__ == "__main__":
    raise SystemExit(main())
