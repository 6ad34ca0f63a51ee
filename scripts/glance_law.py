"""GLANCE on the packaged text models: chain vs budget trees, and the draftability law per workload.

    .venv/bin/python scripts/glance_law.py [--target smollm2-135m-instruct] [--prompts 12]
        [--new-tokens 96] [--workloads code-edit,humaneval,toolcall] [--threads 1]
        [--method NAME=DRAFTER;TREE;CONTROLLER ...] [--law NAME] [--out glance.json]

Each workload's prompts run one after another: autoregressive decoding, then every method (default:
the shipped DFlash head as a chain and as GLANCE's budget trees of 15, 31 and 63 nodes, and 15 nodes
with the extra pass), interleaved per prompt; every output is checked against autoregressive.
Per method and workload: tau, tokens/s and x AR. Then GLANCE's draftability law
(outrider/bench/draftability.py) per workload for each method: the target's next-token entropy
at each round's root (one teacher-forced target forward over prompt + output) against the drafts
the round accepted, fitted (b0, b1), GLANCE's four checks, and a held-out check (fit on the even
prompts, predict the odd ones). The round that ends a request is left out (a stop cuts it).
The paper's target is a vision-language model; this runs its law on text models (docs/methods.md#glance).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

DFLASH = "dflash:smollm2-135m-instruct,vocab=8192"
DEFAULT_METHODS = [
    f"chain={DFLASH};chain;fixed:7",
    f"glance15={DFLASH};glance:15;fixed:7",
    f"glance31={DFLASH};glance:31;fixed:7",
    f"glance63={DFLASH};glance:63;fixed:7",
    f"glance15+extra16={DFLASH};glance:15,8,16;fixed:7",
]


def entropies(target, ids: list[int]) -> torch.Tensor:
    """[len(ids)] the target's next-token entropy (nats) after each position, teacher-forced."""
    from outrider.models.batch import pack

    cache = target.new_cache(1, len(ids) + 8)
    out = target.forward(pack([0], [0], [torch.tensor(ids)], scratch_row=cache.scratch_row), cache)
    logp = torch.log_softmax(out.logits[0].float(), dim=-1)  # [n, V]
    return -(logp.exp() * logp).sum(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--workloads", default="code-edit,humaneval,toolcall")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--method", action="append", help="NAME=DRAFTER;TREE;CONTROLLER (repeatable)")
    parser.add_argument("--cap", type=float, default=None, help="the law's cap L (default: the deepest draft a method makes)")
    parser.add_argument("--out", default=None, help="write every round and fit as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from outrider.bench.draftability import fit_law, held_out
    from outrider.bench.run import encode_prompt
    from outrider.bench.workloads import load_workload
    from outrider.catalog.resolve import resolve_model
    from outrider.engine.generate import generate_ids
    from outrider.engine.request import Request
    from outrider.engine.speculator import SpecOptions, Speculator
    from outrider.weights.loader import load_decoder
    from outrider.weights.tokenizer import eos_ids_of

    folder = resolve_model(args.target)
    target = load_decoder(folder, "cpu", args.dtype)
    tok = AutoTokenizer.from_pretrained(folder)
    eos = set(eos_ids_of(folder, tok))
    methods = {}
    for text in args.method or DEFAULT_METHODS:
        name, _, rest = text.partition("=")
        drafter, tree, controller = rest.split(";")
        methods[name] = Speculator.build(SpecOptions(drafter, tree, controller), target, folder)
    report = {"target": args.target, "dtype": args.dtype, "threads": args.threads, "prompts": args.prompts,
              "new_tokens": args.new_tokens, "methods": args.method or DEFAULT_METHODS, "workloads": {}}
    for wname in args.workloads.split(","):
        workload = load_workload(wname, limit=args.prompts, max_new_tokens=args.new_tokens)
        rows = {m: {"rounds": [], "tokens": 0, "seconds": 0.0, "committed": 0, "n": 0, "mismatch": 0} for m in methods}
        ar_tokens, ar_seconds = 0, 0.0
        for index, prompt in enumerate(workload.prompts):
            ids = list(encode_prompt(tok, workload, prompt))
            start = time.perf_counter()
            plain = generate_ids(target, [Request(ids, args.new_tokens)], eos)[0].token_ids
            ar_seconds += time.perf_counter() - start
            ar_tokens += len(plain)
            H = entropies(target, ids + plain).tolist()
            for name, spec in methods.items():
                start = time.perf_counter()
                done = generate_ids(target, [Request(ids, args.new_tokens)], eos, speculation=spec)[0]
                row = rows[name]
                row["seconds"] += time.perf_counter() - start
                row["tokens"] += len(done.token_ids)
                row["mismatch"] += done.token_ids != plain
                committed = done.round_stats.committed_by_round
                row["committed"] += sum(committed)
                row["n"] += len(committed)
                root = len(ids) - 1  # the first round drafts after the prompt's last token
                for r, c in enumerate(committed):
                    if r < len(committed) - 1:  # the last round may be cut by a stop
                        row["rounds"].append((index, H[root], c - 1))
                    root += c
            print(f"{wname} {prompt.id}: " + ", ".join(f"{m} {len(r['rounds'])}" for m, r in rows.items()), flush=True)
        report["workloads"][wname] = out = {"ar_tok_s": ar_tokens / ar_seconds, "methods": {}}
        print(f"\n== {wname}: {len(workload.prompts)} prompts x {args.new_tokens} tokens; autoregressive "
              f"{ar_tokens / ar_seconds:.1f} tok/s")
        print(f"{'method':>18} {'tau':>5} {'tok/s':>6} {'x AR':>5}  ok  {'b0':>6} {'b1':>6} {'R2curve':>7} {'R2rnd':>6} "
              f"{'ceil':>5} {'rho':>6} holds  held-out R2 (rounds, curve) law<const")
        for name, row in rows.items():
            tok_s = row["tokens"] / row["seconds"]
            entry = {"tau": row["committed"] / max(row["n"], 1), "tok_s": tok_s, "x_ar": tok_s / (ar_tokens / ar_seconds),
                     "mismatches": row["mismatch"], "rounds": row["rounds"]}
            line = f"{name:>18} {entry['tau']:5.2f} {tok_s:6.1f} {entry['x_ar']:5.2f}  {'ok' if not row['mismatch'] else 'NO'}"
            pts = np.array([(i, h, a) for i, h, a in row["rounds"]], float)
            spec = methods[name]  # the law's cap L: the deepest a round can accept (past the block with the extra pass)
            cap = args.cap or spec.controller.max_depth + (spec.drafter.head.block_size if spec.shape.extra else 0)
            try:
                fit = fit_law(pts[:, 1], pts[:, 2], cap=cap)
                even = pts[:, 0] % 2 == 0
                half = fit_law(pts[even, 1], pts[even, 2], cap=cap)
                check = held_out(half, pts[~even, 1], pts[~even, 2], float(pts[even, 2].mean()))
                entry["law"] = {"b0": fit.b0, "b1": fit.b1, "cap": cap, "n": fit.n, "r2_curve": fit.r2_curve,
                                "r2_round": fit.r2_round, "r2_ceiling": fit.r2_ceiling, "spearman": fit.spearman_rho,
                                "spearman_p": fit.spearman_p, "checks": fit.checks(), "holds": fit.holds(),
                                "curve": fit.curve, "held_out": vars(check) | {"beats_constant": check.beats_constant}}
                line += (f"  {fit.b0:6.2f} {fit.b1:6.2f} {fit.r2_curve:7.2f} {fit.r2_round:6.2f} {fit.r2_ceiling:5.2f} "
                         f"{fit.spearman_rho:6.2f} {'yes' if fit.holds() else 'no '}   {check.r2_round:5.2f} "
                         f"{check.r2_curve:5.2f} {'yes' if check.beats_constant else 'no'}")
                if not fit.holds():
                    line += "  failed: " + ",".join(k for k, v in fit.checks().items() if not v)
            except ValueError as err:
                line += f"  (no law: {err})"
            out["methods"][name] = entry
            print(line)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
