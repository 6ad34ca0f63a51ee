"""S2-MoE's self-drafter (`--drafter s2moe:K'`) on the MoE made from SmolLM2-135M (issue 41 items 2
and 4): per target top-k and draft K', greedy tokens against plain decoding, tau, distinct experts
per verify forward (mean over MoE layers) against an AR step's, and wall time against AR,
interleaved per prompt on one thread. The model is a Qwen2-MoE (models/qwen2_moe.py).

    python -m outrider.train.moe_split --split outrider/models/shipped/smollm2-135m-moe8/split.safetensors --out DIR
    python scripts/bench_s2moe.py --moe DIR --target-ks 2,8 --prompts 4 --new 64 --depth 3
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from outrider.bench.datasets import humaneval  # noqa: E402
from outrider.engine.generate import generate_ids  # noqa: E402
from outrider.engine.request import Request  # noqa: E402
from outrider.engine.speculator import SpecOptions, Speculator  # noqa: E402
from outrider.models import moe_layer  # noqa: E402
from outrider.sampling import SamplingParams  # noqa: E402
from outrider.weights.loader import load_decoder  # noqa: E402
from outrider.weights.tokenizer import load_tokenizer  # noqa: E402


class ExpertCounter:
    """Wraps moe_layer.route: the distinct experts each target forward of at most `rows` rows
    chose, per MoE layer (draft forwards, under fewer_experts, and prefills are not counted)."""

    def __init__(self, rows: int):
        self.rows, self.counts, self._route = rows, [], moe_layer.route

    def __enter__(self):
        def counted(x, router, cfg, score_bias=None):
            weights, experts = self._route(x, router, cfg, score_bias)
            if moe_layer._SKIP.get() is None and x.shape[0] <= self.rows:
                self.counts.append(int(experts.unique().numel()))
            return weights, experts

        moe_layer.route = counted
        return self

    def __exit__(self, *exc):
        moe_layer.route = self._route

    def mean(self) -> float:
        return sum(self.counts) / max(len(self.counts), 1)


def run(model, folder, prompt, new, spec, depth):
    speculation = None if spec is None else Speculator.build(SpecOptions(spec, "chain", f"fixed:{depth}"), model, folder)
    with ExpertCounter(depth + 1) as counter:
        start = time.perf_counter()
        done = generate_ids(model, [Request(prompt, new, SamplingParams(0.0))], set(), speculation=speculation)[0]
        wall = time.perf_counter() - start
    return done.token_ids, wall, done.stats.get("mean_accepted_length", 1.0), counter.mean()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--moe", required=True)
    ap.add_argument("--target-ks", default="2,8")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    folder = Path(args.moe)
    tok = load_tokenizer(folder)
    prompts = [tok(p["prompt"], add_special_tokens=False)["input_ids"] for p in humaneval()[: args.prompts]]
    model = load_decoder(folder, "cpu", torch.float32)
    base = model.config
    rows = []
    for k in [int(k) for k in args.target_ks.split(",")]:
        model.config = dataclasses.replace(base, moe=dataclasses.replace(base.moe, top_k=k))
        specs = [f"s2moe:{d}" for d in (1, 2, 4) if d < k]
        run(model, folder, prompts[0], 8, None, args.depth)  # warm-up
        totals = {s: [0.0, 0.0, 0.0, 0, True] for s in [None, *specs]}  # wall, tau sum, experts sum, n, equal
        for prompt in prompts:
            plain = None
            for spec in [None, *specs]:  # interleaved per prompt
                tokens, wall, tau, experts = run(model, folder, prompt, args.new, spec, args.depth)
                plain = tokens if spec is None else plain
                t = totals[spec]
                t[0] += wall
                t[1] += tau
                t[2] += experts
                t[3] += 1
                t[4] = t[4] and tokens == plain
        ar = totals[None][0]
        for spec, (wall, tau, experts, n, equal) in totals.items():
            row = dict(target_k=k, method=spec or "AR", tau=round(tau / n, 2), experts_per_forward=round(experts / n, 2),
                       wall_s=round(wall, 2), speedup=round(ar / wall, 3), tokens_equal=equal)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
