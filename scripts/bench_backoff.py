"""A round that drafts nothing against a plain decode step (issue 42, item 6).

Runs two engines over the same target, one with the server's speculation (drafter + `cost`
controller) and one without, each on `--batch` code-edit prompts (chat mode, SmolLM2 by
default), and times their decode steps in turns once every prompt is prefilled. With enough
sequences the cost controller drafts nothing, so the two must cost the same; `--profile`
prints where a speculative step's time goes (cProfile, the top functions by own time). A third
engine, "follow", runs the speculation as it was before issue 42: the drafter followed (updated)
every round, whether it proposed or not (its speculator's catches_up off). A fourth, "tries",
as it was between that change and the next: the batch rule's try one depth deeper made every
16-256 rounds even where it cannot pay (its controller's bounded_tries off). Medians show a
typical step; means (the total over the steps) what throughput pays, tries included.

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
    trying = Speculator.build(llm.speculator.options, llm.target, llm.path)
    if hasattr(trying.controller, "bounded_tries"):
        trying.controller.bounded_tries = False  # tries deeper where they cannot pay (before the bound)
    engines = {"spec": engine(llm, llm.speculator, prompts, tokens), "follow": engine(llm, old, prompts, tokens),
               "tries": engine(llm, trying, prompts, tokens), "plain": engine(llm, None, prompts, tokens)}
    wall = {name: [] for name in engines}
    cpu = {name: [] for name in engines}  # this thread's CPU time: less moved by the other processes' load
    drafted = dict.fromkeys(engines, 0)
    for _ in range(args.steps):
        for name, eng in engines.items():
            before = sum(s.stats.drafted for s in eng.scheduler.running)
            t, c = time.perf_counter(), time.thread_time()
            eng.step()
            wall[name].append(time.perf_counter() - t)
            cpu[name].append(time.thread_time() - c)
            drafted[name] += sum(s.stats.drafted for s in eng.scheduler.running) - before
    for label, times in (("wall", wall), ("cpu", cpu)):
        for stat, of in (("median", statistics.median), ("mean", statistics.fmean)):
            at = {k: of(v) for k, v in times.items()}
            print(f"batch {args.batch}, {args.steps} steps each, threads {args.threads}, {label} time ({stat}): "
                  + ", ".join(f"{k} {at[k] * 1e3:.2f} ms ({at[k] / at['plain']:.3f}x)" for k in engines))
    print("draft tokens in the timed steps: " + ", ".join(f"{k} {v}" for k, v in drafted.items()))
    if args.profile:
        prof = cProfile.Profile(time.thread_time)
        prof.enable()
        for _ in range(args.steps // 2):
            spec.step()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
