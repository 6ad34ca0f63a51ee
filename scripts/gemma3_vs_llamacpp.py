"""Greedy text of the packaged Gemma 3 270M: Outrider against llama.cpp on the same GGUF.

    .venv/bin/python scripts/gemma3_vs_llamacpp.py --llama-simple BUILD/bin/llama-simple [--new-tokens 64]
        [--dtypes gguf,gguf-i8] [--kv-dtype float32]

llama.cpp's side is its `llama-simple` example (greedy sampler, the prompt tokenized with BOS, K/V
in float16, its own thread count), built from the llama.cpp that llama-cpp-python 0.3.36 vendors;
its text after the prompt is compared with ours for each prompt and each of our --dtypes. Where
the texts part, the first token where they do is located in ours, and our logits there say how
close the top two were: a divergence at a near-tie (llama.cpp's token our second choice, a small
gap) is the arithmetic's order, not a different model. Ours runs greedy, EOS-stopping like
llama-simple, one torch thread.
"""

from __future__ import annotations

import argparse
import subprocess

import torch

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "Once upon a time, in a small village by the sea,", "Here is a list of the planets of the solar system:\n1.",
           "The three laws of thermodynamics are"]


def llama_text(binary: str, gguf: str, prompt: str, n: int) -> str:
    out = subprocess.run([binary, "-m", gguf, "-n", str(n), prompt], capture_output=True, text=True, check=True)
    text = out.stdout.removeprefix("<bos>")  # it prints the prompt's tokens, BOS included
    if not text.startswith(prompt):
        raise SystemExit(f"llama-simple's output does not start with the prompt: {text[:80]!r}")
    return text[len(prompt):].removesuffix("\n")  # it ends its output with one newline of its own


def first_split(model, tok, ids: list[int], ours: list[int], theirs: str) -> str:
    """Where our tokens' text leaves llama.cpp's, and our top two logits there."""
    text = ""
    for i, token in enumerate(ours):
        piece = tok.decode(ours[: i + 1])
        if not theirs.startswith(piece):
            cache = model.new_cache(1, len(ids) + i + 8)
            from outrider.models.batch import pack

            prefix = torch.tensor(ids + ours[:i])
            logits = model.forward(pack([0], [0], [prefix], logits="last", scratch_row=cache.scratch_row),
                                   cache).logits[0, -1]
            top = torch.topk(logits, 5)
            rank = next((r for r in range(1, 5) if theirs.startswith(tok.decode(ours[:i] + [int(top.indices[r])]))),
                        None)
            where = (f"llama.cpp's token is our choice {rank + 1}, {float(top.values[0] - top.values[rank]):.4f} "
                     "below our first" if rank is not None else "llama.cpp's token is not among our top five")
            return (f"token {i}: ours {tok.decode([token])!r}, logits of our top two {float(top.values[0]):.4f} and "
                    f"{float(top.values[1]):.4f} (gap {float(top.values[0] - top.values[1]):.4f}); {where}; llama.cpp "
                    f"goes on {theirs[len(text):len(text) + 24]!r}")
        text = piece
    return "ours is a prefix of llama.cpp's"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-simple", required=True)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dtypes", default="gguf,gguf-i8")
    ap.add_argument("--kv-dtype", default="float32")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from outrider.catalog.packages import gguf_path
    from outrider.catalog.resolve import resolve_model
    from outrider.engine.generate import generate_ids
    from outrider.engine.request import Request
    from outrider.sampling import SamplingParams
    from outrider.weights.loader import load_decoder, parse_kv_dtype
    from outrider.weights.tokenizer import eos_ids_of, load_tokenizer

    path = resolve_model("gemma3-270m")
    tok = load_tokenizer(path)
    eos = eos_ids_of(path, tok)
    theirs = [llama_text(args.llama_simple, str(gguf_path("gemma3-270m")), p, args.new_tokens) for p in PROMPTS]
    for dtype in args.dtypes.split(","):
        model = load_decoder(path, "cpu", dtype, kv_dtype=parse_kv_dtype(args.kv_dtype))
        same = 0
        for prompt, text in zip(PROMPTS, theirs):
            ids = tok(prompt)["input_ids"]
            ours = generate_ids(model, [Request(ids, args.new_tokens, SamplingParams(0.0))], eos)[0].token_ids
            mine = tok.decode(ours)
            equal = mine == text
            same += equal
            print(f"[{dtype}] {prompt[:32]!r}: {'same text' if equal else first_split(model, tok, ids, ours, text)}")
            if not equal:
                print(f"    ours:      {mine[:160]!r}\n    llama.cpp: {text[:160]!r}")
        print(f"[{dtype}] {same} of {len(PROMPTS)} prompts give llama.cpp's text ({args.new_tokens} new tokens, "
              f"K/V {args.kv_dtype})")


if __name__ == "__main__":
    main()
