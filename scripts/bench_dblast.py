"""DBLast against independent block sampling: tau by temperature on HumanEval (docs/methods.md#dblast).

    python scripts/bench_dblast.py --mix PATH [--head smollm2-135m-instruct] [--prompts 4]
        [--samples 2] [--new-tokens 64] [--temperatures 0,0.3,0.7,1.0] [--out FILE.json]

Two chains on SmolLM2-135M-Instruct under `fixed:K` (K = the block's 7 drafts): `dflash:HEAD`, each
position drawn from its own q and verified with it (independent block sampling), and
`dblast:HEAD,mix=PATH`, drafts by component verified with the posterior-marginalised q. Per
temperature, the first --prompts HumanEval prompts (the bench's encoding), --samples unseeded
runs each (rejection sampling; torch.manual_seed(sample) before each method, so a run is
repeatable), all requests of one method and temperature in one batch. Reported: tau (tokens
committed per target forward, pooled over requests), the acceptance rate of the drafts, and the
wall time of each batch (a loaded machine: read only as a rough ratio). Temperature 0 runs greedy
and checks both against plain greedy decoding token for token (exits non-zero if either differs).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mix", required=True, help="the DBLast mixture (dblast.safetensors or its folder)")
    p.add_argument("--head", default="smollm2-135m-instruct")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--depth", type=int, default=7)
    p.add_argument("--temperatures", default="0,0.3,0.7,1.0")
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
    w = load_workload("humaneval", limit=args.prompts, max_new_tokens=args.new_tokens)
    prompts = [encode_prompt(tok, w, q) for q in w.prompts]
    controller = f"fixed:{args.depth}"
    methods = {"independent": f"dflash:{args.head}", "dblast": f"dblast:{args.head},mix={args.mix}"}
    specs = {label: Speculator.build(SpecOptions(spec, "chain", controller), target, path)
             for label, spec in methods.items()}

    def batch(spec, params, seed):
        torch.manual_seed(seed)
        requests = [Request(list(ids), args.new_tokens, params) for ids in prompts]
        began = time.perf_counter()
        done = generate_ids(target, requests, eos, speculation=spec)
        return time.perf_counter() - began, done

    rows, lossless = [], True
    for temperature in [float(t) for t in args.temperatures.split(",")]:
        params = SamplingParams(temperature=temperature)
        plain = batch(None, params, 0)[1] if temperature == 0 else None
        totals = {label: [0, 0, 0, 0, 0.0] for label in specs}  # committed, rounds, drafted, accepted, seconds
        for sample in range(1 if temperature == 0 else args.samples):
            for label, spec in specs.items():  # interleaved, the same seed
                seconds, done = batch(spec, params, sample)
                t = totals[label]
                for i, f in enumerate(done):
                    s = f.round_stats
                    t[0] += s.committed
                    t[1] += s.rounds
                    t[2] += s.drafted
                    t[3] += sum(s.accepted_by_position)
                    if plain is not None and f.token_ids != plain[i].token_ids:
                        print(f"LOSSY: {label} greedy differs from plain on prompt {i}", file=sys.stderr)
                        lossless = False
                t[4] += seconds
        for label, (committed, rounds, drafted, accepted, seconds) in totals.items():
            row = {"temperature": temperature, "method": label, "spec": methods[label], "tau": committed / rounds,
                   "acceptance": accepted / max(drafted, 1), "rounds": rounds, "committed": committed,
                   "seconds": round(seconds, 2)}
            rows.append(row)
            print(f"T {temperature:<4} {label:<12} tau {row['tau']:.3f}  acceptance {row['acceptance']:.3f}  "
                  f"rounds {rounds:4d}  {seconds:6.1f} s", flush=True)
    result = {"model": args.model, "head": args.head, "mix": args.mix, "prompts": args.prompts,
              "samples": args.samples, "new_tokens": args.new_tokens, "controller": controller, "rows": rows,
              "lossless_greedy": lossless, "command": "python scripts/bench_dblast.py " + " ".join(argv or sys.argv[1:])}
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0 if lossless else 1


if __name__ == "__main__":
    raise SystemExit(main())
