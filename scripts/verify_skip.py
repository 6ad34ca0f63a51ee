"""Verifier skipping (LOSSY, `--verifier verify-skip-lossy:T,G`) measured as its paper does.

    .venv/bin/python scripts/verify_skip.py [--target qwen2.5-coder-1.5b-instruct]
        [--drafter draft-model:qwen2.5-coder-0.5b-instruct@q4_0,vocab=65536] [--depth 12] [--block 4]
        [--thresholds 0.99,0.95,0.9,0.8,0.6] [--prompts 10] [--new-tokens 160] [--threads 1] [--out skip.json]

HumanEval's first prompts (the bench's seeded order), completion mode, greedy. For each prompt:
strict verification (T = 2: never skip, which is plain greedy decoding, checked against it) and
each threshold T: verifier calls (rounds), committed tokens, drafts committed unverified, seconds,
and pass@1 with HumanEval's own tests (the completion cut at the first top-level `def`, `class`,
`if`, `print` or `#` line, run with `check(entry_point)` in a subprocess, 10 s limit).
Then the signal's quality on the strict rounds: the AUROC of each draft's raw confidence (and of
its path confidence) for marginal survival (draft i of a block is accepted) and conditional
survival (accepted, given the one before it was), and a learned marginal survival score (logistic
regression on raw and path confidence and position, fitted on the even prompts' rounds) against
raw confidence on the odd prompts' rounds.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

STOPS = ("\ndef ", "\nclass ", "\nif ", "\nprint(", "\n#")


def truncate(completion: str) -> str:
    """HumanEval's usual cut: the completion up to the first top-level stop line."""
    cut = min((completion.find(s) for s in STOPS if s in completion), default=len(completion))
    return completion[:cut]


def passes(problem: dict, completion: str, timeout: float = 10.0) -> bool:
    """HumanEval's own test of prompt + completion, in a fresh interpreter."""
    program = problem["prompt"] + truncate(completion) + "\n\n" + problem["test"] + f"\n\ncheck({problem['entry_point']})\n"
    with tempfile.TemporaryDirectory() as tmp:
        try:
            done = subprocess.run([sys.executable, "-c", program], cwd=tmp, capture_output=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
    return done.returncode == 0


def auroc(score: np.ndarray, label: np.ndarray) -> float:
    """Mann-Whitney AUROC: P(score of a positive > score of a negative), ties half."""
    pos, neg = score[label == 1], score[label == 0]
    if not pos.size or not neg.size:
        return float("nan")
    order = np.argsort(np.concatenate([pos, neg]), kind="mergesort")
    both = np.concatenate([pos, neg])[order]
    ranks = np.empty(both.size)
    ranks[order] = np.arange(1, both.size + 1)
    for value in np.unique(both):  # average ranks over ties
        at = np.concatenate([pos, neg]) == value
        ranks[at] = ranks[at].mean()
    return float((ranks[: pos.size].sum() - pos.size * (pos.size + 1) / 2) / (pos.size * neg.size))


def logistic(x: np.ndarray, y: np.ndarray, steps: int = 500) -> np.ndarray:
    """Weights (bias last) of a logistic regression, by Newton's method with a small ridge."""
    X = np.concatenate([x, np.ones((x.shape[0], 1))], axis=1)
    w = np.zeros(X.shape[1])
    for _ in range(steps):
        p = 1 / (1 + np.exp(-np.clip(X @ w, -30, 30)))
        g = X.T @ (p - y) + 1e-3 * w
        H = (X * (p * (1 - p))[:, None]).T @ X + 1e-3 * np.eye(X.shape[1])
        step = np.linalg.solve(H, g)
        w -= step
        if abs(step).max() < 1e-10:
            break
    return w


def features(raw: list[float], block: int) -> list[list[float]]:
    """Per draft of a strict block: raw confidence, its log, the path confidence's log, position."""
    out, path = [], 0.0
    for i, r in enumerate(raw[:block]):
        path += math.log(max(r, 1e-12))
        out.append([r, math.log(max(r, 1e-12)), path, float(i + 1)])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--drafter", default="draft-model:qwen2.5-coder-0.5b-instruct@q4_0,vocab=65536")
    parser.add_argument("--depth", type=int, default=12, help="the chain drafted each round (--controller fixed:D)")
    parser.add_argument("--block", type=int, default=4, help="G: the verified block")
    parser.add_argument("--thresholds", default="0.99,0.95,0.9,0.8,0.6")
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--new-tokens", type=int, default=160)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-plain", action="store_true",
                        help="skip the autoregressive run (strict verification is plain greedy: tests/test_verify_skip.py)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from outrider.bench import datasets
    from outrider.bench.run import encode_prompt
    from outrider.bench.workloads import data_file, load_workload
    from outrider.catalog.resolve import resolve_model
    from outrider.engine.generate import generate_ids
    from outrider.engine.request import Request
    from outrider.engine.speculator import SpecOptions, Speculator
    from outrider.spec.verifiers import verifier_entry
    from outrider.weights.loader import load_decoder
    from outrider.weights.tokenizer import eos_ids_of

    folder = resolve_model(args.target)
    target = load_decoder(folder, "cpu", args.dtype)
    tok = AutoTokenizer.from_pretrained(folder)
    eos = set(eos_ids_of(folder, tok))
    workload = load_workload("humaneval", limit=args.prompts, max_new_tokens=args.new_tokens)
    problems = {p["task_id"]: p for p in datasets.humaneval(data_file("humaneval", None)[0])}
    strict = 2.0
    thresholds = [strict] + [float(t) for t in args.thresholds.split(",")]
    names = {t: f"verify-skip-lossy:{t},{args.block}" for t in thresholds}
    specs = {t: Speculator.build(SpecOptions(args.drafter, "chain", f"fixed:{args.depth}", verifier=names[t]),
                                 target, folder) for t in thresholds}
    runs = {t: {"calls": 0, "tokens": 0, "skipped": 0, "seconds": 0.0, "passed": 0, "per_prompt": []} for t in thresholds}
    ar = {"tokens": 0, "seconds": 0.0, "passed": 0}
    strict_rounds = []  # (prompt index, raw confidences, accepted of the block)
    for index, prompt in enumerate(workload.prompts):
        ids = list(encode_prompt(tok, workload, prompt))
        problem = problems[prompt.id]
        plain = None
        if not args.no_plain:
            start = time.perf_counter()
            plain = generate_ids(target, [Request(ids, args.new_tokens)], eos)[0].token_ids
            ar["seconds"] += time.perf_counter() - start
            ar["tokens"] += len(plain)
            ar["passed"] += passes(problem, tok.decode(plain, skip_special_tokens=True))
        for t in thresholds:
            verifier = verifier_entry(names[t]).verify
            verifier.rounds.clear()
            start = time.perf_counter()
            done = generate_ids(target, [Request(ids, args.new_tokens)], eos, speculation=specs[t])[0]
            row = runs[t]
            row["seconds"] += time.perf_counter() - start
            if t == strict and plain is None:  # --no-plain: strict verification stands for plain decoding
                plain = done.token_ids
            row["calls"] += done.round_stats.rounds
            row["tokens"] += len(done.token_ids)
            row["skipped"] += sum(r.skipped for r in verifier.rounds)
            ok = passes(problem, tok.decode(done.token_ids, skip_special_tokens=True))
            row["passed"] += ok
            row["per_prompt"].append({"id": prompt.id, "calls": done.round_stats.rounds, "tokens": len(done.token_ids),
                                      "passed": ok, "equal_to_plain": done.token_ids == plain})
            if t == strict:
                if done.token_ids != plain:
                    raise SystemExit(f"{prompt.id}: never skipping differs from plain greedy decoding (a bug)")
                strict_rounds += [(index, r.raw, r.accepted) for r in verifier.rounds]
        print(f"{prompt.id}: " + ", ".join(f"T={t}: {runs[t]['per_prompt'][-1]['calls']} calls "
                                           f"{'pass' if runs[t]['per_prompt'][-1]['passed'] else 'fail'}" for t in thresholds),
              flush=True)
    n = len(workload.prompts)
    print(f"\n{n} HumanEval prompts x {args.new_tokens} tokens; {args.target}, {args.drafter}, fixed:{args.depth}, "
          f"verified block G={args.block}" + ("" if args.no_plain else
          f"; autoregressive pass@1 {ar['passed']}/{n}, {ar['tokens'] / ar['seconds']:.1f} tok/s"))
    ar_tok_s = ar["tokens"] / ar["seconds"] if ar["seconds"] else float("nan")
    print(f"{'T':>6} {'calls':>6} {'saved':>6} {'tok/call':>8} {'unverified':>10} {'pass@1':>7} {'tok/s':>6} {'x AR':>5} equal")
    base = runs[strict]
    for t in thresholds:
        row = runs[t]
        equal = sum(p["equal_to_plain"] for p in row["per_prompt"])
        row.update(saved=1 - row["calls"] / base["calls"], pass_at_1=row["passed"] / n, tok_s=row["tokens"] / row["seconds"])
        print(f"{'never' if t == strict else t:>6} {row['calls']:6d} {row['saved']:6.1%} {row['tokens'] / row['calls']:8.2f} "
              f"{row['skipped'] / max(row['tokens'], 1):10.1%} {row['pass_at_1']:7.2f} {row['tok_s']:6.1f} "
              f"{row['tok_s'] / ar_tok_s:5.2f} {equal}/{n}")
    # the signal, on the strict rounds: per draft of each verified block
    X, marginal, conditional, reached, prompt_of = [], [], [], [], []
    for index, raw, accepted in strict_rounds:
        for i, f in enumerate(features(raw, args.block)):
            X.append(f)
            marginal.append(int(i < accepted))
            conditional.append(int(i < accepted))
            reached.append(i <= accepted)
            prompt_of.append(index)
    X, marginal, reached, prompt_of = np.array(X), np.array(marginal), np.array(reached), np.array(prompt_of)
    conditional = np.array(conditional)
    signal = {"raw": auroc(X[:, 0], marginal), "path": auroc(X[:, 2], marginal),
              "raw_conditional": auroc(X[reached, 0], conditional[reached])}
    even = prompt_of % 2 == 0
    w = logistic(X[even], marginal[even].astype(float))
    learned = np.concatenate([X[~even], np.ones((int((~even).sum()), 1))], axis=1) @ w
    signal.update(learned_marginal_heldout=auroc(learned, marginal[~even]), raw_heldout=auroc(X[~even, 0], marginal[~even]),
                  drafts=int(X.shape[0]), survival_rate=float(marginal.mean()))
    print(f"\nAUROC over {signal['drafts']} strict drafts (marginal survival rate {signal['survival_rate']:.2f}): "
          f"raw confidence {signal['raw']:.3f}, path confidence {signal['path']:.3f}, raw for conditional survival "
          f"{signal['raw_conditional']:.3f}; held-out (odd prompts): learned marginal score "
          f"{signal['learned_marginal_heldout']:.3f} vs raw {signal['raw_heldout']:.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "autoregressive": ar, "runs": {str(t): r for t, r in runs.items()},
                       "signal": signal}, f, indent=1)


if __name__ == "__main__":
    main()
