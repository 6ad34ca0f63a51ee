"""Fit AcceptMoE's commitment prior (spec/acceptmoe.py, CommitPrior) offline on real text: an
exact speculative run (greedy_tree) of the MoE made from SmolLM2-135M with the S2-MoE self-drafter
and a static tree, every drafted node recorded with its depth, its path confidence and whether it
ended on the accepted path. HumanEval prompts from --first on (the measurements use the first
few: bench_moe_select.py), so the fit never sees them.

    python -m outrider.train.moe_split --split outrider/models/shipped/smollm2-135m-moe8/split.safetensors --out DIR
    python scripts/fit_acceptmoe_prior.py --moe DIR --out outrider/models/shipped/acceptmoe_prior.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from outrider.bench.datasets import humaneval
from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.sampling import SamplingParams
from outrider.spec.acceptmoe import CommitPrior
from outrider.spec.tree import depths
from outrider.spec.verify_greedy import GreedyVerifier, follow_tree
from outrider.weights.loader import load_decoder
from outrider.weights.tokenizer import load_tokenizer


class Recording(GreedyVerifier):
    """greedy_tree, exact, recording (depth, confidence, committed) for every drafted node."""

    def __init__(self):
        super().__init__(follow_tree)
        self.records = []

    def from_choices(self, tree, choice):
        result = super().from_choices(tree, choice)
        d = depths(tree.parents).tolist()
        conf = tree.confidence.tolist() if tree.confidence is not None else [None] * tree.size
        accepted = set(result.accepted_nodes)
        self.records += [(d[i], conf[i], i in accepted) for i in range(1, tree.size)]
        return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--moe", required=True)
    ap.add_argument("--drafter", default="s2moe:1")
    ap.add_argument("--tree", default="static:3,2,1")
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--first", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    folder = Path(args.moe)
    tok = load_tokenizer(folder)
    model = load_decoder(folder, "cpu", torch.float32)
    spec = Speculator.build(SpecOptions(args.drafter, args.tree, f"fixed:{args.depth}"), model, folder)
    recorder = Recording()
    spec.verifier_for = lambda params, seeded=False: recorder
    problems = humaneval()[args.first: args.first + args.prompts]
    for p in problems:
        ids = tok(p["prompt"], add_special_tokens=False)["input_ids"]
        generate_ids(model, [Request(ids, args.new, SamplingParams(0.0))], set(), speculation=spec)
    prior = CommitPrior.fit(recorder.records, depth=args.depth)
    source = (f"scripts/fit_acceptmoe_prior.py --moe (smollm2-135m-moe8) --drafter {args.drafter} --tree {args.tree} "
              f"--depth {args.depth} --first {args.first} --prompts {args.prompts} --new {args.new}: "
              f"{len(recorder.records)} drafted nodes")
    prior.save(Path(args.out), source)
    print(source, file=sys.stderr)
    print(Path(args.out).read_text())


if __name__ == "__main__":
    main()
