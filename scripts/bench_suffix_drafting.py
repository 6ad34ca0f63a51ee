"""How long training-free drafting takes per round, on real text, with no model.

The workload is Python standard-library source, tokenized by a simple word-level split (runs of
word characters, runs of whitespace, single symbols; `--tokenize bytes` for bytes). Each file is
one request: its first `--prompt` tokens are the prompt, the next `--generate` tokens the output.
The "target" is the text itself (an oracle: its greedy token is the file's next token), so every
round walks the draft tree along the true continuation, commits the accepted drafts plus one,
and calls `update` exactly as the engine would. Finished requests feed the suffix drafter's
global tree, so later files benefit from earlier ones.

Printed per drafter: microseconds per round for propose + update (mean, p50, p99, max) in CPU
time of this thread (`time.thread_time_ns`: on a shared machine, wall time mostly measures the
other processes; the wall-clock mean is printed beside it),
tau (tokens committed per round, the oracle's acceptance), drafted nodes per round, and for the
suffix drafter the size of its global tree. The max includes Python's full garbage collections,
a pass over every object (the trees' nodes and all of torch's), which land in a few rounds.

    .venv/bin/python scripts/bench_suffix_drafting.py
    .venv/bin/python scripts/bench_suffix_drafting.py --files 40 --alpha 1 2 4
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import time

from outrider.drafters.ngram import NgramDrafter
from outrider.drafters.suffix import SuffixDrafter
from outrider.spec.types import Budget, DraftTree, VerifyResult

WORD = re.compile(r"\w+|\s+|[^\w\s]")


def stdlib_files(count: int) -> list[str]:
    """The `count` largest-first-sorted-by-name .py files of the standard library, as text."""
    root = os.path.dirname(os.__file__)
    names = sorted(n for n in os.listdir(root) if n.endswith(".py"))
    texts = []
    for name in names:
        with open(os.path.join(root, name), encoding="utf-8", errors="replace") as f:
            texts.append(f.read())
        if len(texts) == count:
            break
    return texts


def tokenize(texts: list[str], mode: str) -> list[list[int]]:
    if mode == "bytes":
        return [list(text.encode("utf-8")) for text in texts]
    vocab: dict[str, int] = {}
    return [[vocab.setdefault(piece, len(vocab)) for piece in WORD.findall(text)] for text in texts]


def oracle_accept(tree: DraftTree, truth: list[int]) -> list[int]:
    """Drafts accepted when the target's choices are `truth`: follow matching children."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    accepted, node = [], 0
    for token in truth:
        children = (i for i in range(node + 1, len(tokens)) if parents[i] == node and tokens[i] == token)
        child = next(children, None)
        if child is None:
            break
        accepted.append(child)
        node = child
    return accepted


def run(drafter, docs: list[list[int]], prompt_len: int, generate: int, budget: Budget) -> dict:
    round_us: list[float] = []  # CPU time
    wall_us = 0.0
    rounds = committed = drafted = 0
    for seq_id, doc in enumerate(docs):
        if len(doc) < prompt_len + 2:
            continue
        end = min(len(doc), prompt_len + generate)
        tokens = doc[:prompt_len]
        drafter.start(seq_id, tokens)
        while len(tokens) < end:
            w0, t0 = time.perf_counter_ns(), time.thread_time_ns()
            tree = drafter.propose(seq_id, tokens, budget)
            w1, t1 = time.perf_counter_ns(), time.thread_time_ns()
            truth = doc[len(tokens) : end]
            accepted = oracle_accept(tree, truth[:-1])
            new = truth[: len(accepted) + 1]  # accepted drafts + the bonus (or recovered) token
            w2, t2 = time.perf_counter_ns(), time.thread_time_ns()
            drafter.update(seq_id, VerifyResult(accepted, new))
            w3, t3 = time.perf_counter_ns(), time.thread_time_ns()
            round_us.append((t1 - t0 + t3 - t2) / 1000)
            wall_us += (w1 - w0 + w3 - w2) / 1000
            tokens = tokens + new
            rounds += 1
            committed += len(new)
            drafted += tree.size - 1
        drafter.finish(seq_id, tokens)
    round_us.sort()
    return {
        "rounds": rounds,
        "mean_us": statistics.fmean(round_us),
        "p50_us": round_us[len(round_us) // 2],
        "p99_us": round_us[int(len(round_us) * 0.99)],
        "max_us": round_us[-1],
        "wall_mean_us": wall_us / rounds,
        "tau": committed / rounds,
        "drafted": drafted / rounds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--files", type=int, default=30)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--generate", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--alpha", type=float, nargs="+", default=[1.0], help="one suffix run per value")
    parser.add_argument("--max-depth", type=int, default=SuffixDrafter().max_depth)
    parser.add_argument("--max-match", type=int, default=SuffixDrafter().max_match)
    parser.add_argument("--tokenize", choices=["words", "bytes"], default="words")
    args = parser.parse_args()

    docs = tokenize(stdlib_files(args.files), args.tokenize)
    budget = Budget(depth=args.depth, nodes=args.nodes)
    print(
        f"{len(docs)} stdlib files, {args.tokenize} tokens, prompt {args.prompt}, "
        f"generate {args.generate}, budget depth {args.depth} nodes {args.nodes}, "
        f"suffix max_depth {args.max_depth} max_match {args.max_match}"
    )
    drafters = [("ngram", NgramDrafter(), Budget(args.depth, args.depth))]
    for alpha in args.alpha:
        drafters.append((f"suffix alpha={alpha:g}", SuffixDrafter(args.max_depth, args.max_match, alpha), budget))
    columns = ["rounds", "mean_us", "p50_us", "p99_us", "max_us", "wall_mean_us", "tau", "drafted"]
    print(f"{'drafter':<18}" + "".join(f"{c:>13}" for c in columns))
    for label, drafter, drafter_budget in drafters:
        r = run(drafter, docs, args.prompt, args.generate, drafter_budget)
        print(f"{label:<18}" + "".join(f"{r[c]:>13.{0 if c in ('rounds', 'max_us') else 2}f}" for c in columns))
        if isinstance(drafter, SuffixDrafter):
            tree = drafter.global_tree
            nodes, leaves = tree.num_nodes()
            print(
                f"{'':<18} global tree: {len(tree.sequences)} outputs, {tree.num_tokens} tokens, "
                f"{nodes} nodes + {leaves} leaves ({(nodes + leaves) / max(tree.num_tokens, 1):.2f} per token)"
            )


if __name__ == "__main__":
    main()
