"""Greedy decoding of a MoE made by outrider.train.moe_split with its experts behind the expert
store (models/expert_store.py) at several resident budgets, against every expert resident, in one
run (interleaved rounds): tokens equal, experts read and bytes moved per token, time waiting on
reads, tokens/s. The model is a Qwen2-MoE (models/qwen2_moe.py). The file is read through
safe_open (mmap): on a machine whose page cache holds it the
bytes come from host memory, not disk; what is counted is what the store copies in.

    python scripts/bench_expert_store.py --moe DIR --k 2 --budgets 1.0,0.5,0.25 --new 32
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_split_outrider import _greedy  # noqa: E402

from outrider.models.expert_store import ExpertStore  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--moe", required=True)
    ap.add_argument("--base", default="smollm2-135m-instruct")
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--budgets", default="1.0,0.5,0.25", help="resident share of all layers' experts")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    import tempfile

    from outrider.bench.datasets import humaneval
    from outrider.catalog.resolve import resolve_model
    from outrider.weights.loader import load_decoder
    from outrider.weights.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model(args.base))
    prompt = torch.tensor(tok(humaneval()[1]["prompt"], add_special_tokens=False)["input_ids"])
    cfg = json.loads((Path(args.moe) / "config.json").read_text())
    L, E = cfg["num_hidden_layers"], cfg["num_experts"]
    with tempfile.TemporaryDirectory() as tmp:
        for f in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
            if (Path(args.moe) / f).exists():
                (Path(tmp) / f).symlink_to((Path(args.moe) / f).resolve())
        (Path(tmp) / "config.json").write_text(json.dumps({**cfg, "num_experts_per_tok": args.k}))
        dec = load_decoder(tmp, "cpu", torch.float32)
        resident = [(layer.moe.gate_up, layer.moe.down) for layer in dec.layers]
        path = Path(tmp) / "model.safetensors"
        shares = [float(b) for b in args.budgets.split(",")]
        runs = {"resident": []} | {s: [] for s in shares}
        ref_tokens = None
        for _ in range(args.rounds):
            for name in runs:
                store = None
                if name == "resident":
                    for layer, (gu, dn) in zip(dec.layers, resident):
                        layer.moe.gate_up, layer.moe.down = gu, dn
                else:
                    store = ExpertStore(path, L, E, budget=max(1, round(name * L * E)))
                    for l, layer in enumerate(dec.layers):
                        layer.moe.gate_up, layer.moe.down = store.layer(l)
                t0 = time.perf_counter()
                tokens = _greedy(dec, prompt, args.new)
                seconds = time.perf_counter() - t0
                ref_tokens = ref_tokens or tokens
                row = {"seconds": seconds, "equal": tokens == ref_tokens}
                if store is not None:
                    row |= store.stats.as_dict()
                    store.close()
                runs[name].append(row)
    n = args.new + len(prompt)  # the prefill's rows count too: experts read for the prompt
    out = {"moe": args.moe, "k": args.k, "experts": L * E, "prompt_tokens": len(prompt), "new_tokens": args.new,
           "rounds": args.rounds, "rows": []}
    for name, rs in runs.items():
        best = min(r["seconds"] for r in rs)
        row = {"budget": name if name == "resident" else f"{name:g} ({max(1, round(name * L * E))} experts)",
               "tokens_equal_resident": all(r["equal"] for r in rs), "best_s": round(best, 2),
               "new_tokens_per_s": round(args.new / best, 2)}
        if name != "resident":
            r = rs[-1]
            row |= {"misses": r["misses"], "uses": r["uses"], "MB_read": round(r["bytes_read"] / 2**20, 1),
                    "MB_read_per_new_token": round(r["bytes_read"] / 2**20 / args.new, 2),
                    "read_s": round(r["read_s"], 2), "evictions": r["evictions"]}
        print(json.dumps(row))
        out["rows"].append(row)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
