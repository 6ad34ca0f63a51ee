"""Gemma 3 270M past its 512-token sliding window: a 1,128-token prompt (the first 4,200 characters of
docs/design.md). Our float32 model (the converted folder) against transformers' greedy tokens and
logits, then our --dtype gguf model's plain greedy tokens against a suffix chain and a draft-model
tree (itself at q4_0). One torch thread.

    .venv/bin/python scripts/gemma3_past_window.py
"""
import time
from pathlib import Path

import torch
import transformers as tf
from outrider.catalog.resolve import resolve_model
from outrider.weights.loader import load_decoder
from outrider.weights.tokenizer import load_tokenizer, eos_ids_of
from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.sampling import SamplingParams
torch.set_num_threads(1)
path = resolve_model("gemma3-270m")
tok = load_tokenizer(path)
text = open(Path(__file__).parents[1] / "docs/design.md").read()[:4200]
ids = tok(text)["input_ids"]
print("prompt tokens", len(ids), flush=True)
N = 40
ref = tf.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
t = time.time()
with torch.no_grad():
    out = ref.generate(torch.tensor([ids]), max_new_tokens=N, do_sample=False, eos_token_id=None, pad_token_id=0)
theirs = out[0, len(ids):].tolist()
print("transformers", time.time() - t, flush=True)
ours32 = load_decoder(path, "cpu", torch.float32)
mine = generate_ids(ours32, [Request(ids, N, SamplingParams(0.0))], set())[0].token_ids
print("float32 ours == transformers:", mine == theirs, next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), None), flush=True)
with torch.no_grad():
    want = ref(torch.tensor([ids + mine[:N - 1]])).logits[0, len(ids) - 1:]
from outrider.models.batch import pack
cache = ours32.new_cache(1, len(ids) + N + 4)
got = ours32.forward(pack([0], [0], [torch.tensor(ids + mine[:N - 1])], scratch_row=cache.scratch_row), cache).logits[0, len(ids) - 1:]
print("max |logit diff| past the window:", (got - want).abs().max().item(), "of", want.abs().max().item(), flush=True)
del ref
q = load_decoder(path, "cpu", "gguf")
plain = generate_ids(q, [Request(ids, 64, SamplingParams(0.0))], set())[0].token_ids
for d, tree, c in (("suffix", "chain", "fixed:4"), ("draft-model:gemma3-270m@q4_0", "static:2,2,1,1", "fixed:4")):
    sp = Speculator.build(SpecOptions(d, tree, c), q, path)
    done = generate_ids(q, [Request(ids, 64, SamplingParams(0.0))], set(), speculation=sp)[0]
    print(d, tree, "equal to plain:", done.token_ids == plain, "tau", round(done.stats["mean_accepted_length"], 2), flush=True)
print(repr(tok.decode(plain)))
