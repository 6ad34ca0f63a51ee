"""Golden tau of a DFlash head: its block drafts replayed on the target's own greedy text.

The record is heads/golden.py's (same fields, `compare`, tolerances, `outrider_golden.json`);
only the measurement differs: for each fixed prompt the target generates greedily (one thread,
plain F.linear, as there), one target forward over prompt + output gives the tapped hidden states,
and the DFlash chain is replayed on that text with the runtime head (heads/dflash/head.py):

    the first generated token comes from the prefill (not counted); then each round, with the last
    committed token at position a: the block [x_a, MASK...] over the context 0..a-1 drafts B-1
    tokens, the leading ones equal to the text are accepted, plus the bonus token; a moves on

so `rounds`, `committed` and tau = committed / rounds are what greedy DFlash drafting with a chain
of B-1 gets on these prompts, without the drafter itself (outrider/drafters/dflash.py runs it).
What the head computes (heads/golden_compute.py) is recorded on the same text: the block
[x_a, MASK...] over the context 0..a-1 at every generated position a but the last (anchors), its
B-1 slots' argmaxes and logits, all anchors of a prompt in one `block` call. The record is written
at export and by `outrider train dflash`'s shipped run; `check-head` measures again and compares
(tau exact on the same machine, within 5% / 10% elsewhere; the slots as golden_compute.py says).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..golden import PROMPTS, GoldenSettings
from ..golden_replay import measure_replayed


def measure(head_dir: str | Path, target: str | Path, settings: GoldenSettings = GoldenSettings(),
            prompts=PROMPTS) -> dict:
    """The record's measured part (heads/golden.py's module docstring) for the DFlash
    head in `head_dir` on `target`; settings.depth is ignored (the chain is the block's B-1)."""
    from .format import load_dflash

    return measure_replayed(head_dir, target, settings, prompts, load=load_dflash, replay=replay, logits=block_logits,
                            depth=lambda head: head.block_size - 1, drafting="dflash blocks replayed on greedy text",
                            computes="dflash blocks [x_a, MASK...] at every generated position a, slots 1..B-1")


@torch.inference_mode()
def block_logits(head, own, text: list[int], anchors: list[int]) -> torch.Tensor:
    """The blocks [x_a, MASK...] at `anchors` over the context rows 0..a-1 of slot 0 of `own`
    (replay's cache) in one call: logits [A, B-1, V] over the target vocabulary."""
    if not anchors:
        return torch.zeros(0, head.block_size - 1, head.config.vocab_size)
    block = torch.full((len(anchors), head.block_size), head.config.mask_token_id, dtype=torch.long,
                       device=head.device)  # [A, B]
    block[:, 0] = torch.tensor([text[a] for a in anchors], device=head.device)
    logits, _ = head.block(own, [0] * len(anchors), anchors, block)  # [A, B-1, Vd]
    return head.target_logits(logits)


@torch.inference_mode()
def replay(head, target, text: list[int], prompt_len: int):
    """(rounds, committed, the head's cache of the text's context rows) of greedy DFlash drafting
    along `text` (prompt, then the target's greedy output) from the second generated token on
    (module docstring)."""
    from ...models.batch import causal_batch

    n = len(text)
    if n - prompt_len < 2:
        return 0, 0, None
    taps = head.config.taps(target.config.num_layers)
    tokens = torch.tensor(text, device=target.device)
    cache = target.new_cache(1, n)
    out = target.forward(causal_batch([tokens], hidden_layers=tuple(sorted(set(taps))), scratch_row=cache.scratch_row,
                                      device=target.device), cache)
    features = torch.stack([out.hidden[t][0] for t in taps], dim=1)  # [n, taps, Ht]
    B = head.block_size
    own = head.new_cache(1, n + B)
    head.write_context(own, 0, 0, head.fuse(features))
    rounds = committed = 0
    a = prompt_len  # the first generated token, from the prefill: the first round's root
    while a < n - 1:
        block = torch.full((1, B), head.config.mask_token_id, dtype=torch.long, device=target.device)
        block[0, 0] = text[a]
        logits, _ = head.block(own, [0], [a], block)  # [1, B-1, Vd]
        draft = head.target_ids(logits[0].argmax(-1)).tolist()
        accepted = 0
        while accepted < B - 1 and a + 1 + accepted < n and draft[accepted] == text[a + 1 + accepted]:
            accepted += 1
        step = min(accepted + 1, n - 1 - a)  # the bonus token, unless the text ended
        rounds, committed, a = rounds + 1, committed + step, a + step
    return rounds, committed, own
