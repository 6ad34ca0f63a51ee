"""Measure a mixture of experts made by outrider.train.moe_split against its dense source, in
transformers (Qwen2MoeForCausalLM against LlamaForCausalLM / Qwen2ForCausalLM), one CPU thread:

  - every expert active (num_experts_per_tok = E): the largest |logit difference| on held-out text,
    with the fitted router and with the router zeroed (every weight exactly 1/E: only the float
    summation order differs), and whether greedy tokens are equal
  - at each top-k: perplexity on held-out stdlib windows (files the split never saw), top-1
    agreement with the dense model at every position, and greedy agreement (the share of greedy
    tokens equal to the dense model's before the first difference, on HumanEval prompts)

    python scripts/moe_split_eval.py --moe DIR --base smollm2-135m-instruct --ks 8,6,4,2
"""

from __future__ import annotations

import argparse
import json
import math
import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from outrider.bench.datasets import humaneval
from outrider.catalog.resolve import resolve_model
from outrider.train.distill_hybrid import split_files, windows
from outrider.weights.tokenizer import load_tokenizer


def logits_of(model, tokens: torch.Tensor, batch: int = 4) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model(tokens[s:s + batch]).logits for s in range(0, tokens.shape[0], batch)])


def greedy(model, prompt: torch.Tensor, n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(prompt[None], max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, prompt.shape[0]:].tolist()


def nll(logits: torch.Tensor, tokens: torch.Tensor) -> float:
    return float(F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)))


def prefix_match(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--moe", required=True)
    ap.add_argument("--base", default="smollm2-135m-instruct")
    ap.add_argument("--ks", default="8,6,4,2")
    ap.add_argument("--val", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    base = resolve_model(args.base)
    tok = load_tokenizer(base)
    _, held = split_files(Path(sysconfig.get_paths()["stdlib"]))
    tokens = windows(held, tok, args.val, args.seq_len, args.seed)
    prompts = [torch.tensor(tok(p["prompt"], add_special_tokens=False)["input_ids"])
               for p in humaneval()[:args.prompts]]
    dense = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    ref = logits_of(dense, tokens)
    ref_greedy = [greedy(dense, p, args.new) for p in prompts]
    del dense
    res = {"base": args.base, "moe": args.moe, "held_out_tokens": tokens.numel(), "dense_ppl": round(math.exp(nll(ref, tokens)), 4),
           "prompts": len(prompts), "new_tokens": args.new, "rows": []}
    print(f"dense: ppl {res['dense_ppl']} on {tokens.numel()} held-out tokens")
    E = json.loads((Path(args.moe) / "config.json").read_text())["num_experts"]
    for k in [int(k) for k in args.ks.split(",")]:
        moe = AutoModelForCausalLM.from_pretrained(args.moe, dtype=torch.float32, num_experts_per_tok=k).eval()
        lg = logits_of(moe, tokens)
        gr = [greedy(moe, p, args.new) for p in prompts]
        row = {"k": k, "ppl": round(math.exp(nll(lg, tokens)), 4),
               "top1_agreement": round(float((lg.argmax(-1) == ref.argmax(-1)).float().mean()), 4),
               "greedy_prefix_share": round(sum(prefix_match(a, b) for a, b in zip(gr, ref_greedy)) / (len(prompts) * args.new), 4),
               "greedy_equal_prompts": sum(a == b for a, b in zip(gr, ref_greedy))}
        if k == E:
            row["max_abs_logit_diff"] = float((lg - ref).abs().max())
            for layer in moe.model.layers:  # zeroed router: softmax exactly 1/E, times E in down_proj
                layer.mlp.gate.weight.data.zero_()
            lz = logits_of(moe, tokens)
            row["zero_router_max_abs_logit_diff"] = float((lz - ref).abs().max())
            row["zero_router_greedy_equal_prompts"] = sum(greedy(moe, p, args.new) == b for p, b in zip(prompts, ref_greedy))
        print(json.dumps(row))
        res["rows"].append(row)
        del moe
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
