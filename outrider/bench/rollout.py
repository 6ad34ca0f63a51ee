"""`outrider bench rollout`: an RL rollout batch on one engine, and its makespan.

    outrider bench rollout --workload humaneval --prompts 4 --samples 8 --max-new-tokens 128 --threads 1

Many samples of every prompt at temperature 1 (each its own seed), all sent at once to one
in-process engine (EngineLoop, `--max-running` slots), once with speculation off and once on
(the same engine and drafter; "off" requests carry `speculate=False`). The figure of a rollout
is its makespan: the time from the first request to the last one's end, which the longest
samples decide (TailSieve's setting). Per request it records what the simulator and the OUTLETS
length model read: workload, prompt and its tokens, output tokens, finish time, tau and drafts a
round, and the tokens each of the first four rounds committed (`features`).

Results go to `--out` as results.json: {"plan", "modes": {mode: figures}, "records": [...]}.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass

from ..cluster.length import FEATURE_ROUNDS
from ..errors import ConfigError
from ..sampling import SamplingParams
from .serve_load import percentiles
from .workloads import load_workload



@dataclass(frozen=True)
class RolloutPlan:
    model: str | None = None
    drafter: str = "suffix"
    controller: str = "fixed:4"
    workloads: tuple[str, ...] = ("humaneval",)
    prompts: int = 4
    samples: int = 8
    max_new_tokens: int = 128
    temperature: float = 1.0
    max_running: int | None = None  # None: every request at once
    modes: tuple[str, ...] = ("off", "on")
    threads: int | None = None
    seed: int = 0

    def check(self) -> "RolloutPlan":
        for name in ("prompts", "samples", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(self, name)}")
        if self.max_running is not None and self.max_running < 1:
            raise ConfigError(f"--max-running must be a positive integer, got {self.max_running}")
        if not 1e-4 <= self.temperature <= 2:
            raise ConfigError(f"--temperature must be in [1e-4, 2] (a rollout samples), got {self.temperature}")
        if not self.modes or any(m not in ("off", "on") for m in self.modes):
            raise ConfigError(f"--modes takes off and/or on, got {list(self.modes)}")
        return self


def encode(llm, workload, prompt) -> list[int]:
    """A workload prompt's token ids: chat messages through the model's template, text as is."""
    if not workload.chat:
        return llm.tokenizer(prompt.text)["input_ids"]
    messages = prompt.messages or [{"role": "user", "content": prompt.text}]
    text = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return llm.tokenizer(text, add_special_tokens=False)["input_ids"]


def run_rollout(plan: RolloutPlan, log=print) -> dict:
    from ..engine.loop import EngineLoop
    from ..engine.request import Request
    from ..llm import LLM

    plan.check()
    workloads = [load_workload(w, limit=plan.prompts, seed=plan.seed) for w in plan.workloads]
    llm = LLM(plan.model, drafter=plan.drafter, controller=plan.controller, threads=plan.threads)
    batch = []  # (workload, prompt index, sample, prompt ids)
    for w in workloads:
        for p, prompt in enumerate(w.prompts):
            ids = encode(llm, w, prompt)
            batch += [(w.name, p, s, ids) for s in range(plan.samples)]
    slots = plan.max_running or len(batch)
    headroom = llm.speculator.max_tree_size if llm.speculator is not None else 1
    max_len = max(len(ids) for *_, ids in batch) + plan.max_new_tokens + headroom
    modes, records = {}, []
    for mode in plan.modes:
        engine = EngineLoop(llm.target, llm.eos_ids, llm.speculator, max_running=slots, max_len=max_len)
        ids = {}
        for i, (name, p, s, prompt_ids) in enumerate(batch):
            params = SamplingParams(plan.temperature, seed=plan.seed * 1_000_003 + i)
            ids[engine.add(Request(list(prompt_ids), plan.max_new_tokens, params, speculate=mode == "on"))] = i
        log(f"rollout, speculation {mode}: {len(batch)} requests ({len(workloads)} workloads x {plan.prompts} "
            f"prompts x {plan.samples} samples), {slots} slots")
        start, mine = time.perf_counter(), []
        with llm.cpu_share:
            while engine.has_work:
                for event in engine.step():
                    if event.completion is not None:
                        mine.append(_record(batch[ids[event.request_id]], event.completion, plan, mode,
                                            time.perf_counter() - start))
                llm.cpu_share.tick()
        modes[mode] = _figures(mine)
        log(f"  makespan {modes[mode]['makespan_s']:.1f} s, {modes[mode]['throughput_tok_s']:.1f} tok/s, "
            f"output tokens p50 {modes[mode]['output_tokens']['p50']:.0f} max {modes[mode]['output_tokens']['max']}, "
            f"tau {modes[mode]['tau']:.2f}")
        records += mine
    return {"plan": asdict(plan), "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "cpus": os.cpu_count(), "load_average": list(os.getloadavg()), "modes": modes,
            "records": sorted(records, key=lambda r: (r["mode"], r["workload"], r["prompt"], r["sample"]))}


def _record(item, done, plan: RolloutPlan, mode: str, finished: float) -> dict:
    name, p, s, prompt_ids = item
    stats = done.round_stats
    rounds = max(stats.rounds, 1)
    return {"mode": mode, "workload": name, "prompt": p, "sample": s, "prompt_tokens": len(prompt_ids),
            "max_tokens": plan.max_new_tokens, "output_tokens": len(done.token_ids),
            "finish_reason": done.finish_reason, "finished_s": finished, "rounds": stats.rounds,
            "tau": len(done.token_ids) / rounds, "width": 1.0 + stats.drafted / rounds,
            "features": list(stats.committed_by_round[:FEATURE_ROUNDS]) if mode == "on" else []}


def _figures(records: list[dict]) -> dict:
    lengths = [r["output_tokens"] for r in records]
    makespan = max(r["finished_s"] for r in records)
    tokens, rounds = sum(lengths), sum(r["rounds"] for r in records)
    return {"requests": len(records), "makespan_s": makespan, "output_tokens_total": tokens,
            "throughput_tok_s": tokens / makespan if makespan > 0 else 0.0, "tau": tokens / max(rounds, 1),
            "output_tokens": {**percentiles([float(x) for x in lengths]), "max": max(lengths),
                              "stdev": statistics.pstdev(lengths)},
            "finished_s": percentiles([r["finished_s"] for r in records]),
            "finish_reasons": {k: sum(r["finish_reason"] == k for r in records)
                               for k in sorted({r["finish_reason"] for r in records})}}
