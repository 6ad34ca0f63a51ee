"""FunctionalMLA (seed #24) on real weights: the packaged Qwen2.5-Coder-0.5B draft converted to latent
attention the MHA2MLA way (outrider/train/mla_convert.py), then each converted attention trained to
reproduce the original's output after o_proj on calibration inputs (outrider/train/mla_reconstruct.py),
and the draft's acceptance (tau) against the packaged Qwen2.5-Coder-1.5B target measured before
conversion, after it and after reconstruction, for each rank r; with the draft's K/V bytes a token.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/functional_mla.py --ranks 64,128,256 --out mla.json

Recipe (the defaults): calibration: --calib windows of --calib-len tokens of the Python standard
library's sources (train/distill_hybrid.py's split: its training files; --val held-out ones for the
nmse), one window a file, seed --seed; conversion: the --pairs fastest RoPE frequencies of each
head kept (--keep high), the rest of K and V jointly SVD'd to rank r; reconstruction: Adam, --steps
minibatches of --batch windows a layer at --lr (cosine to 0), every layer from the source's own
residual stream; acceptance: the first --prompts HumanEval prompts as plain text, --tokens greedy
tokens each, a draft-model chain of --k (fixed), the draft in float32 (the source dequantized from
its GGUF, as the conversion reads it), the target in its own GGUF blocks; the committed tokens are
checked equal to the target's plain greedy tokens. The converted weights are written under --work
(not shipped: this recipe regenerates them) and removed unless --keep-weights.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import sysconfig
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from outrider.bench import datasets
from outrider.catalog.resolve import resolve_model
from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.models.batch import causal_batch
from outrider.models.layers import rms_norm
from outrider.sampling import SamplingParams
from outrider.train.distill_hybrid import split_files, windows
from outrider.train.mla_convert import convert
from outrider.train.mla_reconstruct import MlaAttention, Sizes, reconstruct, source_attention
from outrider.weights.loader import auto_dtype, load_decoder


def calibration(source: Path, raw: dict, tokenizer, args) -> tuple[list, list]:
    """Per layer, (normed inputs, source attention outputs) on the training windows and held-out."""
    train_files, held = split_files(Path(sysconfig.get_paths()["stdlib"]))
    sets = [windows(train_files, tokenizer, args.calib, args.calib_len, args.seed),
            windows(held, tokenizer, args.val, args.calib_len, args.seed + 1)]
    model = load_decoder(source, "cpu", torch.float32)
    L, eps = int(raw["num_hidden_layers"]), float(raw["rms_norm_eps"])
    out = []
    for ids in sets:
        hidden = {}
        for start in range(0, ids.shape[0], 4):  # 4 windows a forward
            part = list(ids[start:start + 4])
            cache = model.new_cache(len(part), args.calib_len)
            got = model.forward(causal_batch(part, tuple(range(L)), scratch_row=cache.scratch_row), cache).hidden
            for layer in range(L):
                h = rms_norm(got[layer], model.layers[layer].input_norm, eps)  # [b, T, E]
                hidden.setdefault(layer, []).append(h)
        out.append({layer: torch.cat(parts) for layer, parts in hidden.items()})
    del model
    return out[0], out[1]


def attention_weights(tensors: dict, layer: int) -> dict:
    prefix = f"model.layers.{layer}.self_attn."
    return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}


def write_model(folder: Path, source: Path, base: Path, attention: dict, raw: dict) -> Path:
    """A converted model: the source's other tensors (one shared file, hard-linked), its attention."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (source / name).is_file():
            shutil.copy(source / name, folder / name)
    if not (folder / "base.safetensors").exists():
        os.link(base, folder / "base.safetensors")
    save_file(attention, folder / "attention.safetensors")
    (folder / "config.json").write_text(json.dumps(raw, indent=2))
    return folder


def acceptance(target, target_path: Path, draft: Path, prompts: list, args, plain: list) -> dict:
    requests = [Request(p, args.tokens, SamplingParams(0.0)) for p in prompts]
    speculator = Speculator.build(SpecOptions(f"draft-model:{draft}@float32", "chain", f"fixed:{args.k}"),
                                  target, target_path)
    start = time.perf_counter()
    done = generate_ids(target, requests, set(), speculation=speculator)
    committed = sum(c.stats["committed"] for c in done)
    rounds = sum(c.stats["rounds"] for c in done)
    exact = [c.token_ids for c in done] == plain
    draft_model = speculator.drafter.decoder if hasattr(speculator.drafter, "decoder") else None
    per_token = None
    if draft_model is not None:
        cache = draft_model.new_cache(1, 1)
        per_token = cache.nbytes() // (cache.max_len + 1)  # one slot: bytes a position holds
    return {"tau": committed / max(rounds, 1), "rounds": rounds, "committed": committed, "exact": exact,
            "kv_bytes_per_token": per_token, "seconds": time.perf_counter() - start}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--ranks", default="64,128,192")
    ap.add_argument("--pairs", type=int, default=8, help="RoPE frequencies kept a head (dr = 2 pairs)")
    ap.add_argument("--balance", action="store_true", help="TransMLA's K/V balancing before the joint SVD")
    ap.add_argument("--keep", default="high", choices=("high", "uniform"))
    ap.add_argument("--calib", type=int, default=24)
    ap.add_argument("--val", type=int, default=4)
    ap.add_argument("--calib-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--work", type=Path, default=Path("/tmp/functional_mla"))
    ap.add_argument("--keep-weights", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("functional_mla.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    from transformers import AutoTokenizer

    source, target_path = resolve_model(args.draft), resolve_model(args.target)
    raw = json.loads((source / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(source)
    tensors = load_file(source / "model.safetensors")
    args.work.mkdir(parents=True, exist_ok=True)
    base = args.work / "base.safetensors"
    save_file({k: v for k, v in tensors.items() if ".self_attn." not in k}, base)
    sizes = Sizes(int(raw["num_attention_heads"]), int(raw["num_key_value_heads"]), int(raw["head_dim"]),
                  float(raw["rope_theta"]))
    t0 = time.perf_counter()
    x_train, x_val = calibration(source, raw, tokenizer, args)
    L = int(raw["num_hidden_layers"])
    with torch.no_grad():
        y_train = {l: source_attention(attention_weights(tensors, l), x_train[l], sizes) for l in range(L)}
        y_val = {l: source_attention(attention_weights(tensors, l), x_val[l], sizes) for l in range(L)}
    print(f"calibration: {x_train[0].shape[0]} + {x_val[0].shape[0]} windows of {args.calib_len} tokens "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)

    problems = datasets.humaneval()[: args.prompts]
    prompts = [tokenizer(p["prompt"], add_special_tokens=False)["input_ids"] for p in problems]
    target = load_decoder(target_path, "cpu", auto_dtype(target_path))
    plain = [c.token_ids for c in generate_ids(target, [Request(p, args.tokens, SamplingParams(0.0)) for p in prompts],
                                               set())]
    result = {"command": " ".join(sys.argv), "args": {k: str(v) for k, v in vars(args).items()},
              "machine": "see docs/benchmarks (Intel Xeon Ice Lake, 2 cores, shared)", "runs": []}
    source_tau = acceptance(target, target_path, source, prompts, args, plain)
    result["source"] = source_tau
    print(f"source draft: tau {source_tau['tau']:.3f}, {source_tau['kv_bytes_per_token']} K/V bytes a token, "
          f"exact {source_tau['exact']}", flush=True)
    for rank in [int(r) for r in args.ranks.split(",")]:
        converted, mla_raw = convert({k: v for k, v in tensors.items() if ".self_attn." in k}, raw, rank,
                                     args.pairs, args.keep, args.balance)
        folder = write_model(args.work / f"r{rank}-converted", source, base, converted, mla_raw)
        after = acceptance(target, target_path, folder, prompts, args, plain)
        print(f"r {rank}: converted tau {after['tau']:.3f}, {after['kv_bytes_per_token']} bytes a token", flush=True)
        trained, layers = {}, []
        t0 = time.perf_counter()
        for l in range(L):
            prefix = f"model.layers.{l}.self_attn."
            module = MlaAttention({k[len(prefix):]: v for k, v in converted.items() if k.startswith(prefix)}, mla_raw)
            before, fit = reconstruct(module, x_train[l], y_train[l], x_val[l], y_val[l], steps=args.steps,
                                      lr=args.lr, batch=args.batch, seed=args.seed + l)
            layers.append({"layer": l, "nmse_converted": before, "nmse_reconstructed": fit})
            trained.update({prefix + k: v for k, v in module.tensors().items()})
            print(f"  layer {l}: nmse {before:.4f} -> {fit:.4f}", flush=True)
        folder = write_model(args.work / f"r{rank}-reconstructed", source, base, trained, mla_raw)
        rebuilt = acceptance(target, target_path, folder, prompts, args, plain)
        print(f"r {rank}: reconstructed tau {rebuilt['tau']:.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)
        result["runs"].append({"rank": rank, "converted": after, "reconstructed": rebuilt, "layers": layers,
                               "reconstruction_s": time.perf_counter() - t0})
        args.out.write_text(json.dumps(result, indent=2))
    if not args.keep_weights:
        shutil.rmtree(args.work)
    args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
