"""The MTP head's golden (the record: heads/golden.py): greedy speculative generation with the head
drafting a chain of `depth` (`LLM(target, drafter="mtp:DIR")`, one torch thread, plain F.linear),
and what it computes along each prompt's text at every generated position: the chain of `depth`
slots fed the text's tokens, exactly as EAGLE-3's golden (heads/eagle3/golden.py `chain_logits`,
which takes any head with the EAGLE-3 head's interface: the MTP head has it).
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch

from ...config import overriding
from ..eagle3.golden import chain_logits
from ..golden import PROMPTS, GoldenSettings, machine
from ..golden_compute import measured_part, top_of


def measure(head_dir: str | Path, target: str | Path, settings: GoldenSettings = GoldenSettings(),
            prompts=PROMPTS) -> dict:
    """The record's measured part for the MTP head in `head_dir` on `target`."""
    from ...llm import LLM
    from .format import load_mtp

    threads = torch.get_num_threads()
    with overriding(linear="linear", threads=1):
        try:
            llm = LLM(str(target), drafter=f"mtp:{head_dir}", tree="chain", controller=f"fixed:{settings.depth}",
                      device=settings.device, dtype=settings.dtype)
            chat = settings.chat if settings.chat is not None else bool(getattr(llm.tokenizer, "chat_template", None))
            head = load_mtp(head_dir, llm.target)
            results, prompt_ids, anchors, tops = [], [], [], []
            for prompt in prompts:
                ids = llm.encode(prompt, chat)
                prompt_ids.append(ids)
                out = llm.generate(prompt, settings.max_new_tokens, chat=chat)
                results.append({"rounds": out.stats["rounds"], "committed": out.stats["committed"],
                                "output_ids": list(out.token_ids)})
                text = ids + list(out.token_ids)
                rows = list(range(max(len(ids) - 2, 0), len(text) - settings.depth))
                anchors.append([r + 2 for r in rows])
                tops.append(top_of(chain_logits(head, llm.target, text, rows, settings.depth)))
        finally:
            torch.set_num_threads(threads)
    rounds, committed = sum(r["rounds"] for r in results), sum(r["committed"] for r in results)
    resolved = {"temperature": 0.0, "tree": "chain", **asdict(settings), "chat": chat, "threads": 1, "linear": "linear"}
    return {"settings": resolved, "prompts": list(prompts), "prompt_ids": prompt_ids, "results": results,
            "rounds": rounds, "committed": committed, "tau": committed / max(rounds, 1),
            "measured_on": machine(settings.device),
            "computes": measured_part("mtp chains fed the text at every generated position, slots 1..depth",
                                      settings.depth, anchors, tops)}
