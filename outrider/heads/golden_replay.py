"""The measured part of a block head's golden (DFlash, DSpark): for each fixed prompt the target
generates greedily (one thread, plain F.linear), the head's greedy chain is replayed on that text
(`replay`, the kind's: rounds and committed tokens, and the target's cache it tapped), and what the
head computes at every generated position but the last is recorded (`logits`, the kind's: slots'
logits [A, depth, V], all anchors of a prompt in one call). The record's fields, tolerances and
comparison are heads/golden.py's and heads/golden_compute.py's; each kind's golden.py says what its
replay and logits are."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch

from ..config import overriding
from .golden import GoldenSettings, machine
from .golden_compute import measured_part, top_of


def measure_replayed(head_dir: str | Path, target: str | Path, settings: GoldenSettings, prompts, *,
                     load: Callable, replay: Callable, logits: Callable, depth: Callable[[object], int],
                     drafting: str, computes: str) -> dict:
    """The record's measured part: `load(head_dir, target_model)` the head, `replay(head, target,
    text, start)` -> (rounds, committed, cache), `logits(head, cache, text, anchors)` -> [A, d, V],
    `depth(head)` the chain's drafts a round; `drafting` and `computes` say what was measured."""
    from ..llm import LLM

    threads = torch.get_num_threads()
    with overriding(linear="linear", threads=1):
        try:
            llm = LLM(str(target), device=settings.device, dtype=settings.dtype)
            head = load(head_dir, llm.target)
            chat = settings.chat if settings.chat is not None else bool(getattr(llm.tokenizer, "chat_template", None))
            results, prompt_ids, anchors, tops = [], [], [], []
            for prompt in prompts:
                ids = llm.encode(prompt, chat)
                out = list(llm.generate(prompt, settings.max_new_tokens, chat=chat).token_ids)
                prompt_ids.append(ids)
                rounds, committed, own = replay(head, llm.target, ids + out, len(ids))
                results.append({"rounds": rounds, "committed": committed, "output_ids": out})
                anchors.append(list(range(len(ids), len(ids) + len(out) - 1)))
                tops.append(top_of(logits(head, own, ids + out, anchors[-1])))
        finally:
            torch.set_num_threads(threads)
    rounds, committed = sum(r["rounds"] for r in results), sum(r["committed"] for r in results)
    resolved = {"temperature": 0.0, "tree": "chain", **asdict(settings), "depth": depth(head),
                "chat": chat, "threads": 1, "linear": "linear", "drafting": drafting}
    return {"settings": resolved, "prompts": list(prompts), "prompt_ids": prompt_ids, "results": results,
            "rounds": rounds, "committed": committed, "tau": committed / max(rounds, 1),
            "measured_on": machine(settings.device),
            "computes": measured_part(computes, depth(head), anchors, tops)}
