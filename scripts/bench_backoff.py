"""A round that drafts nothing against a plain decode step (issue 42, item 6).

Runs two engines over the same target, one with the server's speculation (drafter + `cost`
controller) and one without, each on `--batch` code-edit prompts (chat mode, SmolLM2 by
default), and times their decode steps in turns once every prompt is prefilled. With enough
sequences the cost controller drafts nothing, so the two must cost the same; `--profile`
prints where a speculative step's time goes (cProfile, the top functions by own time). A third
engine, "follow", runs the speculation as it was before issue 42: the drafter followed (updated)
every round, whether it proposed or not (its speculator's catches_up off).

    .venv/bin/python scripts/bench_backoff.py --batch 16 --steps 40 --threads 2 [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch

from outrider.bench.workloads import load_workload
from outrider.engine.loop import EngineLoop
from outrider.engine.request import Request
from outrider.engine.speculator import Speculator
from outrider.llm import LLM


def engine(llm: LLM, spec, prompts: list[list[int]], max_tokens: int) -> EngineLoop:
    eng = EngineLoop(llm.target, set(), spec, max_running=len(prompts), max_len=1024)
    for p in prompts:
        eng.add(Request(p, max_tokens, ignore_eos=True))
    while any(not s.decoding for s in eng.scheduler.running) or eng.num_waiting:
        eng.step()  # prefills (and, once a prompt is in, its first rounds)
    return eng


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--drafter", default="suffix")
    ap.add_argument("--controller", default="cost")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=40, help="timed steps per engine")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, drafter=args.drafter, controller=args.controller, threads=args.threads)
    work = load_workload("code-edit", limit=args.batch)
    prompts = [llm.tokenizer.apply_chat_template(p.messages, add_generation_prompt=True, tokenize=True)
               if p.messages else llm.encode(p.text) for p in work.prompts]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    tokens = args.steps * 2 + 8
    old = Speculator.build(llm.speculator.options, llm.target, llm.path)
    old.catches_up = False  # the drafter follows every round (before issue 42, item 6)
    spec, follow, plain = (engine(llm, llm.speculator, prompts, tokens), engine(llm, old, prompts, tokens),
                           engine(llm, None, prompts, tokens))
    wall = {"spec": [], "follow": [], "plain": []}
    cpu = {"spec": [], "follow": [], "plain": []}  # this thread's CPU time: less moved by the other processes' load
    drafted = 0
    for _ in range(args.steps):
        for name, eng in (("spec", spec), ("follow", follow), ("plain", plain)):
            before = sum(s.stats.drafted for s in eng.scheduler.running)
            t, c = time.perf_counter(), time.thread_time()
            eng.step()
            wall[name].append(time.perf_counter() - t)
            cpu[name].append(time.thread_time() - c)
            if name == "spec":
                drafted += sum(s.stats.drafted for s in eng.scheduler.running) - before
    for label, times in (("wall", wall), ("cpu", cpu)):
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"batch {args.batch}, {args.steps} steps each, threads {args.threads}, {label} time (median): spec step "
              f"{med['spec'] * 1e3:.2f} ms ({med['spec'] / med['plain']:.3f}x plain), following every round "
              f"{med['follow'] * 1e3:.2f} ms ({med['follow'] / med['plain']:.3f}x), plain {med['plain'] * 1e3:.2f} ms")
    print(f"drafted {drafted} tokens in the spec engine's timed steps")
    if args.profile:
        prof = cProfile.Profile(time.thread_time)
        prof.enable()
        for _ in range(args.steps // 2):
            spec.step()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
