"""Train OUTLETS' output-length model (outrider/cluster/length.py) from rollout bench records.

    .venv/bin/outrider bench rollout --workload humaneval --workload code-edit --workload toolcall \
        --prompts 4 --samples 8 --max-new-tokens 128 --max-running 16 --threads 1 --out rollout
    .venv/bin/python scripts/train_outlets_length.py rollout/results.json \
        --out outrider/cluster/outlets_length.json

The shipped weights: `scripts/train_outlets_length.py docs/scheduling-records.json` (the two runs'
records of docs/scheduling.md, each marked with its `run`).

Every record of the given results (speculation off and on alike: the output length does not
depend on it) is a training row. The features a request has when it arrives are its prompt's
length and its workload; the drafter features (tokens committed by the first rounds) exist only
once it runs, so by default they are left out (`--with-drafter-features` keeps them, for a
router that re-ranks after the first rounds). Prints the fit on held-out prompts (every
`--holdout`-th prompt of each workload) against predicting the training mean, then fits on
everything and writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from outrider.cluster.length import LengthModel
from outrider.cluster.policy import RequestInfo


def records_of(paths: list[str], drafter: bool) -> list[dict]:
    """One record per sample: a sample run with speculation off and on is one row (the 'on' one, which
    has drafter features); with the same seed the two outputs nearly always agree (45-96 of 48-96
    in the runs of docs/scheduling.md: sampled verification draws otherwise after a rejection)."""
    out = {}
    for path in paths:
        for r in json.loads(Path(path).read_text())["records"]:
            key = (path, r.get("run"), r["workload"], r["prompt"], r["sample"])
            if key not in out or r["mode"] == "on":
                out[key] = {**r, "features": r.get("features", []) if drafter else []}
    return list(out.values())


def rms_log_error(model: LengthModel, records: list[dict]) -> float:
    errors = [(model.log_length(RequestInfo("r", r["prompt_tokens"], r["max_tokens"], 0.0, workload=r["workload"],
                                            features=tuple(r["features"]))) - math.log1p(r["output_tokens"])) ** 2
              for r in records]
    return math.sqrt(sum(errors) / len(errors))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", help="results.json files of `outrider bench rollout`")
    ap.add_argument("--out", default="outrider/cluster/outlets_length.json")
    ap.add_argument("--holdout", type=int, default=4, help="hold out every Nth prompt of each workload to report")
    ap.add_argument("--with-drafter-features", action="store_true")
    args = ap.parse_args(argv)
    records = records_of(args.results, args.with_drafter_features)
    test = [r for r in records if r["prompt"] % args.holdout == args.holdout - 1]
    train = [r for r in records if r["prompt"] % args.holdout != args.holdout - 1]
    if train and test:
        model = LengthModel.fit(train)
        mean = sum(math.log1p(r["output_tokens"]) for r in train) / len(train)
        base = math.sqrt(sum((mean - math.log1p(r["output_tokens"])) ** 2 for r in test) / len(test))
        print(f"held out {len(test)} of {len(records)} records: RMS log error {rms_log_error(model, test):.3f} "
              f"(the training mean: {base:.3f})")
    meta = {"command": "python " + " ".join(sys.argv), "sources": args.results,
            "drafter_features": args.with_drafter_features}
    model = LengthModel.fit(records, meta=meta)
    model.save(args.out)
    print(f"fitted on {len(records)} records (RMS log error {model.residual:.3f}): {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
