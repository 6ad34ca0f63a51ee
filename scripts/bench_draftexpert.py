"""DraftExpert (`--drafter draftexpert`) and plain speculation against AR decoding on a MoE made by
outrider.train.moe_split, with every expert resident and under an offload budget (the experts
behind an expert store holding a share of them), in one run, interleaved per prompt (issue 41's
done-when: "under an offload budget, at least one lossless method beats AR on the same budget").

Requests stop at the tokenizer's end-of-text tokens (`--past-eos`: always --new tokens, the text
past the end included). Per method and tier: greedy tokens equal to AR's (every method is lossless), tau, decode time
(the request's time less its prefill) and its ratio to AR's in the same tier, verify forwards,
distinct target experts a verify routes to (all MoE layers), bytes read and read stalls per
committed token, and for DraftExpert the share of each verify's experts its draft predicted
(prefetch hit rate) and prefetches used.

Tiers (--tiers): `resident` (the loaded model), `page:S` (models/expert_store.py at share S of all
experts: misses copied from the page-cached file), `direct:S` (slow_tier.DirectStore: misses read
with O_DIRECT, past the page cache), `paced:S:G` (slow_tier.PacedStore: an emulated tier of G GB/s).
A fresh store per request (cold; the prompt's prefill fills it, the same for every method).

    python -m outrider.train.moe_split --split outrider/models/shipped/smollm2-135m-moe8/split.safetensors --out DIR
    python scripts/bench_draftexpert.py --moe DIR --prompts 3 --new 48 \\
        --methods "AR;suffix;draftexpert:conf=0.1" --tiers "resident;page:0.25;direct:0.25"
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from outrider.bench.datasets import humaneval
from outrider.bench.run import encode_prompt
from outrider.bench.workloads import load_workload
from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.models import moe_layer
from outrider.models.draft_experts import RouterWatch, moe_layers
from outrider.models.expert_store import ExpertStore
from outrider.models.slow_tier import DirectStore, PacedStore
from outrider.sampling import SamplingParams
from outrider.weights.loader import load_decoder
from outrider.weights.tokenizer import eos_ids_of, load_tokenizer


class VerifyWatch:
    """Watches the target's routers: each target forward of at most `rows` rows (a verify or an AR
    step; not the prefill, not a draft under fewer_experts) as the set of (layer, expert) pairs its
    rows route to."""

    def __init__(self, model, rows: int):
        self.model, self.rows, self.forwards = model, rows, []
        self.first, self.last = moe_layers(model)[0], moe_layers(model)[-1]
        self.on_first = None  # called at the prefill's last MoE layer (the same reads for every method)

    def __enter__(self):
        self.saved = [(l, self.model.layers[l].moe.router) for l in moe_layers(self.model)]
        for l, r in self.saved:
            self.model.layers[l].moe.router = RouterWatch(r, l, self.sink)
        return self

    def __exit__(self, *exc):
        for l, r in self.saved:
            self.model.layers[l].moe.router = r

    def sink(self, layer, x, logits):
        if moe_layer._SKIP.get() is not None:
            return
        if x.shape[0] > self.rows:  # the prefill: at its last MoE layer's routing, the decode's counts start
            if layer == self.last and self.on_first is not None and not self.forwards:
                self.on_first()
            return
        if layer == self.first:
            self.forwards.append(set())
        k = self.model.config.moe.top_k
        self.forwards[-1] |= {(layer, int(e)) for e in torch.topk(logits.float(), k, dim=-1)[1].unique().tolist()}


def make_store(tier: str, path: Path, L: int, N: int):
    kind, _, rest = tier.partition(":")
    if kind == "resident":
        return None
    parts = rest.split(":")
    budget = max(1, round(float(parts[0]) * L * N))
    if kind == "page":
        return ExpertStore(path, L, N, budget)
    if kind == "direct":
        return DirectStore(path, L, N, budget)
    if kind == "paced":
        return PacedStore(path, L, N, budget, float(parts[1]))
    raise SystemExit(f"unknown tier {tier!r}")


def run_one(model, folder, prompt, new, method, depth, store, eos=frozenset()):
    layers = moe_layers(model)
    saved = [(model.layers[l].moe.gate_up, model.layers[l].moe.down) for l in layers]
    if store is not None:
        for l in layers:
            model.layers[l].moe.gate_up, model.layers[l].moe.down = store.layer(l)
    speculation = None
    if method != "AR":
        drafter, _, control = method.partition("@")
        speculation = Speculator.build(SpecOptions(drafter, "chain", control or f"fixed:{depth}"), model, folder)
    snap = {}
    try:
        with VerifyWatch(model, depth + 1) as watch:
            if store is not None:
                watch.on_first = lambda: snap.update(store.stats.as_dict())
            t0 = time.perf_counter()
            done = generate_ids(model, [Request(prompt, new, SamplingParams(0.0))], set(eos), speculation=speculation)[0]
            wall = time.perf_counter() - t0
    finally:
        for l, (gu, dn) in zip(layers, saved):
            model.layers[l].moe.gate_up, model.layers[l].moe.down = gu, dn
    if done.error:
        raise SystemExit(f"{method}: {done.error}")
    row = {"tokens": done.token_ids, "decode_s": wall - done.stats["prefill_s"], "n": len(done.token_ids),
           "tau": done.stats.get("mean_accepted_length", 1.0), "verifies": len(watch.forwards),
           "distinct": sum(len(f) for f in watch.forwards)}
    if store is not None:
        end = store.stats.as_dict()
        store.wait()
        for key in ("bytes_read", "read_s", "stall_s", "misses", "prefetched", "prefetch_used"):
            row[key] = end[key] - snap.get(key, 0)
        store.close()
    rounds = getattr(getattr(speculation, "drafter", None), "rounds", None)
    if rounds:
        hits = [len(r["pairs"] & f) / max(len(f), 1) for r, f in zip(rounds, watch.forwards)]
        row["predicted_share"] = sum(hits) / max(len(hits), 1)
        row["stops_expand"] = sum(r["stop"] == "expand" for r in rounds)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--moe", required=True)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--workload", default="humaneval-raw", help="humaneval-raw, or a bench workload (code-edit, ...)")
    ap.add_argument("--skip", type=int, default=0, help="prompts skipped first")
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--k", type=int, default=None, help="route each token to its top k experts (default: the config's)")
    ap.add_argument("--past-eos", action="store_true", help="do not stop at the end-of-text token (always --new tokens)")
    ap.add_argument("--methods", default="AR;suffix;draftexpert", help="';'-separated; DRAFTER[@CONTROLLER]")
    ap.add_argument("--tiers", default="resident;page:0.25")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    folder = Path(args.moe)
    tok = load_tokenizer(folder)
    if args.workload == "humaneval-raw":  # the HumanEval prompts as raw completions (bench_s2moe.py's)
        problems = humaneval()[args.skip: args.skip + args.prompts]
        prompts = [tok(p["prompt"], add_special_tokens=False)["input_ids"] for p in problems]
    else:  # a bench workload, as `outrider bench` feeds it (chat template where it is a chat workload)
        w = load_workload(args.workload, limit=args.skip + args.prompts)
        prompts = [encode_prompt(tok, w, p) for p in w.prompts[args.skip:]]
    model = load_decoder(folder, "cpu", torch.float32)
    eos = frozenset() if args.past_eos else frozenset(eos_ids_of(folder, tok))
    if args.k is not None:  # the same experts routed top-k (docs/models.md: k 4 is nearer the dense model)
        model.config = dataclasses.replace(model.config, moe=dataclasses.replace(model.config.moe, top_k=args.k))
    cfg = json.loads((folder / "config.json").read_text())
    L, N = cfg["num_hidden_layers"], cfg["num_experts"]
    methods, tiers = args.methods.split(";"), args.tiers.split(";")
    run_one(model, folder, prompts[0], 4, "AR", args.depth, None)  # warm-up: paths measured
    totals: dict[tuple, list] = {}
    reference = {}
    for i, prompt in enumerate(prompts):
        for tier in tiers:  # interleaved: every method on this prompt and tier before the next
            for method in methods:
                row = run_one(model, folder, prompt, args.new, method, args.depth,
                              make_store(tier, folder / "model.safetensors", L, N), eos)
                reference.setdefault(i, row["tokens"])
                row["equal"] = row["tokens"] == reference[i]
                totals.setdefault((tier, method), []).append(row)
                print(json.dumps({"prompt": i, "tier": tier, "method": method,
                                  **{k: v for k, v in row.items() if k != "tokens"}}), flush=True)
    out = []
    for (tier, method), rows in totals.items():
        n = sum(r["n"] for r in rows)
        dec = sum(r["decode_s"] for r in rows)
        ar = sum(r["decode_s"] for r in totals[(tier, "AR")]) if (tier, "AR") in totals else None
        v = sum(r["verifies"] for r in rows)
        row = {"tier": tier, "method": method, "tokens_equal_AR": all(r["equal"] for r in rows),
               "tau": round(sum(r["tau"] for r in rows) / len(rows), 2), "decode_s": round(dec, 2),
               "ms_per_token": round(1000 * dec / n, 1), "speedup_vs_AR_same_tier": round(ar / dec, 3) if ar else None,
               "verifies": v, "distinct_experts_per_verify": round(sum(r["distinct"] for r in rows) / max(v, 1), 1)}
        if "bytes_read" in rows[0]:
            row |= {"MB_read_per_token": round(sum(r["bytes_read"] for r in rows) / 2**20 / n, 2),
                    "MB_read_per_verify": round(sum(r["bytes_read"] for r in rows) / 2**20 / max(v, 1), 2),
                    "stall_ms_per_token": round(1000 * sum(r["stall_s"] for r in rows) / n, 1),
                    "read_ms_per_token": round(1000 * sum(r["read_s"] for r in rows) / n, 1),
                    "prefetched": sum(r["prefetched"] for r in rows), "prefetch_used": sum(r["prefetch_used"] for r in rows)}
        if "predicted_share" in rows[0]:
            row["predicted_share_of_verify_experts"] = round(sum(r["predicted_share"] for r in rows) / len(rows), 3)
            row["rounds_stopped_by_expansion"] = sum(r["stops_expand"] for r in rows)
        out.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": out}, indent=1) + "\n")


if __name__ == "__main__":
    main()
