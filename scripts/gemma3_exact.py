"""Greedy speculative tokens against plain decoding on the packaged Gemma 3 270M, several drafters,
four prompts (prose, code, a story, a list), one process, one torch thread; the model in its own
dtype (`--dtype gguf`).

    .venv/bin/python scripts/gemma3_exact.py NEW_TOKENS "DRAFTER|TREE|CONTROLLER;..."
    .venv/bin/python scripts/gemma3_exact.py 96 "suffix|chain|fixed:4;ngram|chain|fixed:4;early-exit:9|static:2,2,1|fixed:3"

Prints plain decoding's text, then per drafter whether each prompt's tokens equal plain's, its tau
and the time against plain's.
"""
import sys, time, torch
from outrider.catalog.resolve import resolve_model
from outrider.weights.loader import load_decoder, auto_dtype
from outrider.weights.tokenizer import load_tokenizer, eos_ids_of
from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.sampling import SamplingParams
torch.set_num_threads(1)
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "Once upon a time, in a small village by the sea,", "Here is a list of the planets of the solar system:\n1."]
N = int(sys.argv[1])
path = resolve_model("gemma3-270m")
dtype = auto_dtype(path, "cpu")
model = load_decoder(path, "cpu", dtype)
tok = load_tokenizer(path); eos = eos_ids_of(path, tok)
print("dtype", dtype, "eos", eos, flush=True)
reqs = [Request(tok(p)["input_ids"], N, SamplingParams(0.0)) for p in PROMPTS]
def run(spec):
    t = time.perf_counter(); out = []
    for r in reqs:
        out.append(generate_ids(model, [r], eos, speculation=spec)[0])
    return out, time.perf_counter() - t
plain, tp = run(None)
print(f"plain {sum(len(c.token_ids) for c in plain)} tokens {tp:.1f}s", flush=True)
for p, c in zip(PROMPTS, plain):
    print(repr(p[:20]), repr(tok.decode(c.token_ids)[:150]))
for spec in sys.argv[2].split(";"):
    drafter, tree, control = spec.split("|")
    sp = Speculator.build(SpecOptions(drafter, tree, control), model, path)
    got, t = run(sp)
    same = [a.token_ids == b.token_ids for a, b in zip(got, plain)]
    taus = [round(c.stats["mean_accepted_length"], 2) for c in got]
    print(f"{drafter} {tree} {control}: equal {same} tau {taus} time {t:.1f}s vs plain {tp:.1f}s", flush=True)
