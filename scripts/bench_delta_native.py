"""The gated-delta state arithmetic native (csrc/gated_delta.c) against its torch reference
(models/gated_delta.py), at Qwen3.5-0.8B's gated-delta shapes (16 value heads, dk = dv = 128):

- per call: a verify step of a chain of N nodes (N = 1 is a decode step) and the fold of N
  committed rows, the two alternated call by call, median of --repeats;
- whole decoding: a random-weight hybrid at 0.8B's widths (hidden 1024, MLP 3584, three
  gated-delta layers then one attention layer, q4 weights), greedy, plain and with the suffix
  drafter, the same tokens checked on both.

Times are the calling thread's CPU time (time.thread_time) beside wall time: on a machine shared
with other work the first is the steadier. One torch thread.

    .venv/bin/python scripts/bench_delta_native.py [--repeats 30] [--tokens 48] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from outrider.kernels import delta_native, native
from outrider.models import gated_delta

HV, DK, DV = 16, 128, 128


def _inputs(n: int, gen: torch.Generator):
    q = torch.randn(n, HV, DK, generator=gen) * DK ** -0.5
    k = F.normalize(torch.randn(n, HV, DK, generator=gen), dim=-1)
    return q, k, torch.randn(n, HV, DV, generator=gen), -torch.rand(n, HV, generator=gen) * 0.5, \
        torch.rand(n, HV, generator=gen)


def _timed(fn) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.thread_time()
    fn()
    return time.perf_counter() - wall, time.thread_time() - cpu


def per_call(repeats: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    S = torch.randn(HV, DK, DV, generator=gen, dtype=torch.float64)
    rows = []
    for n in (1, 2, 4, 8, 15):
        q, k, v, g, b = _inputs(n, gen)
        anc = torch.ones(n, n, dtype=torch.bool).tril(-1)
        _, stash = gated_delta.tree_step(q, k, v, g, b, S, anc)
        got = {}
        for _ in range(repeats):
            for name, ops in (("native", delta_native.NATIVE), ("torch", delta_native.TORCH)):
                got.setdefault(("step", name), []).append(_timed(lambda: ops.tree_step(q, k, v, g, b, S, anc)))
                target = S.clone()
                got.setdefault(("fold", name), []).append(_timed(lambda: ops.fold_into(target, stash)))
        for what in ("step", "fold"):
            med = {name: [statistics.median(t[i] for t in got[(what, name)]) * 1e3 for i in (0, 1)]
                   for name in ("native", "torch")}
            rows.append(dict(what=what, nodes=n, native_ms=med["native"], torch_ms=med["torch"],
                             ratio_cpu=med["torch"][1] / med["native"][1]))
    return rows


def decoding(tokens: int, repeats: int) -> list[dict]:
    import transformers as tf

    from outrider.engine.generate import generate_ids
    from outrider.engine.request import Request
    from outrider.engine.speculator import SpecOptions, Speculator
    from outrider.sampling import SamplingParams
    from outrider.weights.loader import load_decoder

    folder = Path(tempfile.mkdtemp(prefix="delta-bench-"))
    config = tf.Qwen3_5TextConfig(
        vocab_size=4096, hidden_size=1024, intermediate_size=3584, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, head_dim=256, max_position_embeddings=4096, tie_word_embeddings=True,
        linear_conv_kernel_dim=4, linear_key_head_dim=DK, linear_value_head_dim=DV, linear_num_key_heads=HV,
        linear_num_value_heads=HV,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})
    torch.manual_seed(0)
    tf.Qwen3_5ForCausalLM(config).eval().save_pretrained(folder)
    model = load_decoder(folder, "cpu", "q4")
    half = torch.randint(0, 4096, (50,), generator=torch.Generator().manual_seed(1)).tolist()
    prompt = half + half  # something for the suffix drafter to copy
    choose = delta_native.DeltaOps.choose
    times, outs = {}, {}
    try:
        for _ in range(repeats):
            for name, ops in (("native", delta_native.NATIVE), ("torch", delta_native.TORCH)):
                delta_native.DeltaOps.choose = classmethod(lambda cls, device="cpu", ops=ops: ops)
                for how in ("plain", "suffix"):
                    spec = None if how == "plain" else Speculator.build(SpecOptions("suffix", "chain", "fixed:4"),
                                                                        model, folder)
                    box = {}
                    t = _timed(lambda: box.update(out=generate_ids(
                        model, [Request(prompt, tokens, SamplingParams(0.0))], set(), speculation=spec)[0]))
                    times.setdefault((how, name), []).append(t)
                    outs.setdefault(how, []).append(box["out"].token_ids)
    finally:
        delta_native.DeltaOps.choose = choose
    every = [o for runs in outs.values() for o in runs]
    assert all(o == every[0] for o in every), "native and torch gave different tokens"
    rows = []
    for how in ("plain", "suffix"):
        med = {name: [statistics.median(t[i] for t in times[(how, name)]) for i in (0, 1)] for name in ("native", "torch")}
        rows.append(dict(decoding=how, tokens=tokens, native_s=med["native"], torch_s=med["torch"],
                         ratio_wall=med["torch"][0] / med["native"][0], ratio_cpu=med["torch"][1] / med["native"][1]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if not native.available():
        raise SystemExit(f"no native library here: {native.reason()}")
    print(f"variant {native.variant()}")
    calls = per_call(args.repeats)
    for r in calls:
        print(f"{r['what']:4s} N={r['nodes']:2d}  native {r['native_ms'][1]:.3f} ms cpu ({r['native_ms'][0]:.3f} wall)"
              f"  torch {r['torch_ms'][1]:.3f} ms cpu ({r['torch_ms'][0]:.3f} wall)  torch/native {r['ratio_cpu']:.2f}x")
    runs = decoding(args.tokens, max(2, args.repeats // 10))
    for r in runs:
        print(f"{r['decoding']:6s} {r['tokens']} tokens  native {r['native_s'][1]:.2f} s cpu  torch {r['torch_s'][1]:.2f}"
              f" s cpu  torch/native {r['ratio_cpu']:.2f}x cpu, {r['ratio_wall']:.2f}x wall; tokens equal")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(variant=native.variant(), calls=calls, decoding=runs), indent=1))


if __name__ == "__main__":
    main()
