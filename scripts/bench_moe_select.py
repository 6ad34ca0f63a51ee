"""AcceptMoE and EdgeXpert (`--verifier acceptmoe-lossy...`, `edgexpert-lossy...`, both LOSSY) on the
MoE made from SmolLM2-135M (issue 41 item 4): per configuration, against plain greedy decoding and
the exact tree verify (greedy_tree) of the same drafter and tree, in one run, interleaved per prompt:

    tau, distinct experts and bytes per verify forward (selected, and exact routing's on the same
    rows), bytes an LRU set of R experts a layer moves in (simulated), KL(exact || selected) and
    top-1 agreement of the verify logits (a second pass with an exact forward beside each verify),
    greedy drift against plain (tokens equal at the same position, first divergence); with --timed
    wall time too, from a run of its own (the compared run does an exact forward beside each verify).

With --store-share S the runs are repeated with the experts behind the expert store
(models/expert_store.py) holding S of all layers' experts: bytes really copied in per new token,
stall seconds and wall time, AR included (the offload baseline). The exact configuration is
`acceptmoe-lossy:1` (every expert eligible: greedy_tree's tokens bit for bit, tests/test_moe_select.py),
run through the selection only to count its traffic.

    python -m outrider.train.moe_split --split outrider/models/shipped/smollm2-135m-moe8/split.safetensors --out DIR
    python scripts/bench_moe_select.py --moe DIR --prompts 3 --new 32 --json out.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from outrider.bench.datasets import humaneval
from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.models.expert_store import ExpertStore
from outrider.sampling import SamplingParams
from outrider.spec.verifiers import verifier_entry
from outrider.weights.loader import load_decoder
from outrider.weights.tokenizer import load_tokenizer

EXACT = "acceptmoe-lossy:1"
CONFIGS = (EXACT, "acceptmoe-lossy:1,resident=2", "acceptmoe-lossy:0.9", "acceptmoe-lossy:0.7", "acceptmoe-lossy:0.5",
           "acceptmoe-lossy:0.7,resident=2", "edgexpert-lossy:2", "edgexpert-lossy:3,important=0.5",
           "edgexpert-lossy:2,important=1", "edgexpert-lossy:8,important=0.25")


DRAFTER = ["s2moe:1"]  # --drafter


def _generate(model, folder, prompt, new, verifier, tree, depth, compare=False):
    spec = None
    if verifier is not None:
        spec = Speculator.build(SpecOptions(DRAFTER[0], tree, f"fixed:{depth}", verifier=verifier), model, folder)
        selection = verifier_entry(verifier).verify.selection
        selection.reset()
        selection.compare = compare
    start = time.perf_counter()
    done = generate_ids(model, [Request(prompt, new, SamplingParams(0.0))], set(), speculation=spec)[0]
    wall = time.perf_counter() - start
    report = {} if verifier is None else verifier_entry(verifier).verify.selection.report()
    return done.token_ids, wall, done.stats.get("mean_accepted_length", 1.0), report


def _drift(tokens, plain):
    same = sum(a == b for a, b in zip(tokens, plain))
    first = next((i for i, (a, b) in enumerate(zip(tokens, plain)) if a != b), len(plain))
    return same, first


def _use_store(model, path, share, layers, experts):
    store = ExpertStore(path, layers, experts, budget=max(1, round(share * layers * experts)))
    for i, layer in enumerate(model.layers):
        layer.moe.gate_up, layer.moe.down = store.layer(i)
    return store


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--moe", required=True)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--tree", default="static:3,2,1")
    ap.add_argument("--drafter", default="s2moe:1", help="e.g. s2moe:1,expand=0.05 (the routing-aware expansion)")
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--configs", default=";".join(CONFIGS), help="verifier names, ';'-separated")
    ap.add_argument("--timed", action="store_true", help="also a timed run without the exact forward beside")
    ap.add_argument("--store-share", type=float, default=None)
    ap.add_argument("--store-configs", default=f"{EXACT};acceptmoe-lossy:0.7;acceptmoe-lossy:0.7,resident=2;"
                                                "edgexpert-lossy:2")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    DRAFTER[0] = args.drafter
    folder = Path(args.moe)
    tok = load_tokenizer(folder)
    model = load_decoder(folder, "cpu", torch.float32)
    prompts = [tok(p["prompt"], add_special_tokens=False)["input_ids"] for p in humaneval()[: args.prompts]]
    configs = args.configs.split(";")
    rows = {name: {"tokens": 0, "same": 0, "first": [], "wall": 0.0, "tau": [], "reports": []} for name in configs}
    plain_wall, plains = 0.0, []
    for prompt in prompts:
        plain, wall, _, _ = _generate(model, folder, prompt, args.new, None, args.tree, args.depth)
        plains.append(plain)
        plain_wall += wall
        for name in configs:
            wall = None
            if args.timed:
                _, wall, _, _ = _generate(model, folder, prompt, args.new, name, args.tree, args.depth)
            tokens, _, tau, report = _generate(model, folder, prompt, args.new, name, args.tree, args.depth, compare=True)
            same, first = _drift(tokens, plain)
            r = rows[name]
            r["tokens"] += len(plain)
            r["same"] += same
            r["first"].append(first)
            r["wall"] = None if wall is None else r["wall"] + wall
            r["tau"].append(tau)
            r["reports"].append(report)
    out = {"moe": str(folder), "prompts": args.prompts, "new": args.new, "tree": args.tree, "depth": args.depth,
           "drafter": args.drafter, "plain_wall_s": plain_wall, "rows": []}
    for name, r in rows.items():
        verify = [rep["traffic"]["verify"] for rep in r["reports"]]
        forwards = sum(v["forwards"] for v in verify)
        layers = sum(v["layers"] for v in verify) / max(forwards, 1)
        quality = [rep.get("quality") for rep in r["reports"] if rep.get("quality")]
        qrows = sum(q["rows"] for q in quality)
        prefill = [rep["traffic"].get("prefill") for rep in r["reports"] if rep["traffic"].get("prefill")]
        row = {"verifier": name, "tau": sum(r["tau"]) / len(r["tau"]), "speedup_vs_ar": plain_wall / r["wall"] if r["wall"] else None,
               "tokens_equal_plain": f"{r['same']}/{r['tokens']}", "first_divergence": r["first"],
               "verify_forwards": forwards, "moe_layers": layers,
               "distinct_per_verify_per_layer": sum(v["distinct"] for v in verify) / max(forwards * layers, 1),
               "exact_distinct_per_verify_per_layer": sum(v["distinct_exact"] for v in verify) / max(forwards * layers, 1),
               "MB_per_verify": sum(v["bytes"] for v in verify) / max(forwards, 1) / 2**20,
               "exact_MB_per_verify": sum(v["bytes_exact"] for v in verify) / max(forwards, 1) / 2**20,
               "lru_MB_moved_per_new_token": (sum(v["moved"] for v in verify) / r["tokens"] / 2**20
                                              if r["reports"][0]["traffic"]["lru_budget_per_layer"] else None),
               "kl_mean": sum(q["kl_mean"] * q["rows"] for q in quality) / max(qrows, 1),
               "top1_agreement": sum(q["top1_agreement"] * q["rows"] for q in quality) / max(qrows, 1)}
        prows = sum(q.get("path_rows", 0) for q in quality)
        row |= {"path_kl_mean": sum(q.get("path_kl_mean", 0) * q.get("path_rows", 0) for q in quality) / max(prows, 1),
                "path_top1_agreement": (sum(q.get("path_top1_agreement", 0) * q.get("path_rows", 0) for q in quality)
                                        / max(prows, 1))}
        if prefill:
            row["prefill_distinct_per_layer"] = sum(p["distinct"] for p in prefill) / max(sum(p["layers"] for p in prefill), 1)
            row["prefill_exact_distinct_per_layer"] = (sum(p["distinct_exact"] for p in prefill)
                                                      / max(sum(p["layers"] for p in prefill), 1))
        out["rows"].append(row)
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    if args.store_share is not None:
        out["store"] = _store_runs(args, model, folder, prompts, plains)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


def _store_runs(args, model, folder, prompts, plains):
    cfg = json.loads((folder / "config.json").read_text())
    layers, experts = cfg["num_hidden_layers"], cfg["num_experts"]
    resident = [(layer.moe.gate_up, layer.moe.down) for layer in model.layers]
    names = [None] + args.store_configs.split(";")
    got = {str(n): {"wall": 0.0, "bytes": 0, "stall": 0.0, "tokens": 0, "same": 0} for n in names}
    for prompt, plain in zip(prompts, plains):
        for name in names:
            store = _use_store(model, folder / "model.safetensors", args.store_share, layers, experts)
            try:
                tokens, wall, _, _ = _generate(model, folder, prompt, args.new, name, args.tree, args.depth)
            finally:
                store.close()
                for layer, (gu, dn) in zip(model.layers, resident):
                    layer.moe.gate_up, layer.moe.down = gu, dn
            g = got[str(name)]
            g["wall"] += wall
            g["bytes"] += store.stats.bytes_read
            g["stall"] += store.stats.stall_s
            g["tokens"] += len(plain)
            g["same"] += _drift(tokens, plain)[0]
    ar = got["None"]["wall"]
    rows = []
    for name, g in got.items():
        row = {"verifier": "AR (plain)" if name == "None" else name, "share": args.store_share,
               "MB_read_per_new_token": g["bytes"] / g["tokens"] / 2**20, "stall_s": g["stall"],
               "wall_s": g["wall"], "speedup_vs_ar_same_budget": ar / g["wall"],
               "tokens_equal_plain": f"{g['same']}/{g['tokens']}"}
        rows.append(row)
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    return rows


if __name__ == "__main__":
    main()
