"""The EAGLE-3 head's golden (the record: heads/golden.py): greedy speculative generation with the
head drafting a chain of `depth` (`LLM(target, drafter="eagle3:DIR")`, one torch thread, plain
F.linear), and what it computes (`"computes"`, heads/golden_compute.py): along each prompt's text
(prompt + the target's own greedy output, the `output_ids`, as the chain is lossless) at every
generated position p (the anchors), the chain of `depth` slots a draft there takes, fed the text's
tokens instead of the head's drafts: slot 1 is the head's row over the target's feature of position
p-2 and token x_{p-1}, predicting x_p; slot k predicts x_{p+k-1}, fed x_{p+k-2} and slot k-1's
output hidden (`chain_logits`). Those inputs depend on the prompts and the target only, so a
changed weight shows as changed argmaxes or logits even where tau does not move.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch

from ...config import overriding
from ..golden import PROMPTS, GoldenSettings, machine
from ..golden_compute import measured_part, top_of


def measure(head_dir: str | Path, target: str | Path, settings: GoldenSettings = GoldenSettings(),
            prompts=PROMPTS) -> dict:
    """Greedy speculative generation of each prompt (one at a time) with the head in `head_dir`
    drafting for `target`; the record's measured part (see the module docstring)."""
    from ...llm import LLM
    from .format import load_eagle3

    threads = torch.get_num_threads()
    # The CPU's matrix-product path is otherwise chosen by timing (kernels/cpu_linear.py), which a
    # busy machine can tip between near-equal paths: pin plain F.linear so the golden's arithmetic
    # (and the exact same-machine comparison) never depends on load.
    with overriding(linear="linear", threads=1):
        try:
            llm = LLM(str(target), drafter=f"eagle3:{head_dir}", tree="chain",
                      controller=f"fixed:{settings.depth}", device=settings.device, dtype=settings.dtype)
            chat = settings.chat if settings.chat is not None else bool(getattr(llm.tokenizer, "chat_template", None))
            head = load_eagle3(head_dir, llm.target)
            results, prompt_ids, anchors, tops = [], [], [], []
            for prompt in prompts:
                ids = llm.encode(prompt, chat)
                prompt_ids.append(ids)
                out = llm.generate(prompt, settings.max_new_tokens, chat=chat)
                results.append({"rounds": out.stats["rounds"], "committed": out.stats["committed"],
                                "output_ids": list(out.token_ids)})
                text = ids + list(out.token_ids)
                rows = list(range(max(len(ids) - 2, 0), len(text) - settings.depth))  # each chain's last committed row
                anchors.append([r + 2 for r in rows])  # the position slot 1 predicts
                tops.append(top_of(chain_logits(head, llm.target, text, rows, settings.depth)))
        finally:
            torch.set_num_threads(threads)
    rounds, committed = sum(r["rounds"] for r in results), sum(r["committed"] for r in results)
    resolved = {"temperature": 0.0, "tree": "chain", **asdict(settings), "chat": chat, "threads": 1, "linear": "linear"}
    return {"settings": resolved, "prompts": list(prompts), "prompt_ids": prompt_ids, "results": results,
            "rounds": rounds, "committed": committed, "tau": committed / max(rounds, 1),
            "measured_on": machine(settings.device),
            "computes": measured_part("eagle3 chains fed the text at every generated position, slots 1..depth",
                                      settings.depth, anchors, tops)}


@torch.inference_mode()
def chain_logits(head, target, text: list[int], rows: list[int], depth: int) -> torch.Tensor:
    """Logits [len(rows), depth, V] over the target vocabulary of the head's chain after each
    committed row r in `rows` (r + depth < len(text)), fed the text's tokens: slot 1 is row r
    ((feature r, token x_{r+1}) predicting x_{r+2}), slot k the node at position r + k - 1
    (token x_{r+k}, input slot k-1's output hidden) as drafters/eagle3.py's chain feeds it."""
    from ...models.batch import causal_batch, pack

    n = len(text)
    out = torch.zeros(len(rows), depth, head.config.vocab_size)
    if not rows:
        return out
    tokens = torch.tensor(text, device=target.device)
    taps = head.config.taps(target.config.num_layers)
    cache = target.new_cache(1, n)
    hidden = target.forward(causal_batch([tokens], hidden_layers=tuple(sorted(set(taps))),
                                         scratch_row=cache.scratch_row, device=target.device), cache).hidden
    features = torch.stack([hidden[t][0] for t in taps], dim=1)[: n - 1]  # [n-1, 3, Ht]
    own = head.new_cache(1, n + depth)
    batch = pack([0], [0], [tokens[1:]], scratch_row=own.scratch_row, device=head.device)
    logits, outs = head.forward(batch, own, head.fuse(features).unsqueeze(0))  # [1, n-1, Vd], [1, n-1, H]
    for i in reversed(range(len(rows))):  # last first: a chain overwrites only rows past its own r
        r = rows[i]
        step, h = logits[0, r], outs[0, r]
        out[i, 0] = head.target_logits(step).cpu()
        for k in range(2, depth + 1):
            d = k - 1  # the node's index in the chain (node 0: row r)
            feed = pack([0], [r], [tokens[r + k: r + k + 1]], [torch.arange(-1, d)], scratch_row=own.scratch_row,
                        device=head.device, first_nodes=[d])
            step, h = head.forward(feed, own, h.view(1, 1, -1))
            step, h = step[0, 0], h[0, 0]
            out[i, d] = head.target_logits(step).cpu()
    return out


