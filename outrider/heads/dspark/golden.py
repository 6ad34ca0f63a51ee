"""Golden of a DSpark head: its greedy chains replayed on the target's own greedy text, and what it
computes there (the record and its comparison are heads/golden.py's and heads/golden_compute.py's).

For each fixed prompt the target generates greedily (one thread, plain F.linear); one target
forward over prompt + output gives the tapped hidden states; then, as DSpark drafts greedily
(drafters/dspark.py `markov_chain`, the Markov head fed its own drafts):

    each round, with the last committed token at position a: the backbone pass over [x_a, MASK...]
    and the context 0..a-1, the chain of gamma drafts through the Markov head; the leading drafts
    equal to the text are accepted, plus the bonus token; a moves on

`tau` = committed / rounds. The computes: at every generated position a but the last, the gamma
slots' logits with the Markov correction teacher-forced on the text (prev = x_a .. x_{a+gamma-1}),
all anchors of a prompt in one backbone call: a zeroed Markov or backbone tensor moves them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..golden import PROMPTS, GoldenSettings
from ..golden_replay import measure_replayed


def measure(head_dir: str | Path, target: str | Path, settings: GoldenSettings = GoldenSettings(),
            prompts=PROMPTS) -> dict:
    """The record's measured part for the DSpark head in `head_dir` on `target` (the chain: gamma)."""
    from .format import load_dspark

    return measure_replayed(head_dir, target, settings, prompts, load=load_dspark, replay=replay, logits=forced_logits,
                            depth=lambda head: head.gamma, drafting="dspark chains replayed on greedy text",
                            computes=("dspark blocks [x_a, MASK...] at every generated position a, slots 1..gamma, "
                                      "Markov head teacher-forced on the text"))


@torch.inference_mode()
def forced_logits(head, own, text: list[int], anchors: list[int]) -> torch.Tensor:
    """[A, gamma, V] over the target vocabulary: the blocks at `anchors` over the context rows
    0..a-1 of slot 0 of `own`, each slot corrected by the Markov head with the text's previous token."""
    B, G = head.block_size, head.gamma
    if not anchors:
        return torch.zeros(0, G, head.config.vocab_size)
    block = torch.full((len(anchors), B), head.config.mask_token_id, dtype=torch.long, device=head.device)
    block[:, 0] = torch.tensor([text[a] for a in anchors], device=head.device)
    U, hbar = head.block(own, [0] * len(anchors), anchors, block)  # [A, G, Vd], [A, G, H]
    padded = text + [text[-1]] * G
    prev = torch.tensor([[padded[a + j] for j in range(G)] for a in anchors], device=head.device)  # [A, G]
    state, out = None, []
    for j in range(G):
        logits, state = head.step(U[:, j], hbar[:, j], prev[:, j], state)
        out.append(logits)
    return head.target_logits(torch.stack(out, 1))


@torch.inference_mode()
def replay(head, target, text: list[int], prompt_len: int):
    """(rounds, committed, the head's cache of the text's context rows) of greedy DSpark drafting
    along `text` from the second generated token on (module docstring)."""
    from ...drafters.block import Block
    from ...drafters.dspark import markov_chain
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
    B, G = head.block_size, head.gamma
    own = head.new_cache(1, n + B)
    head.write_context(own, 0, 0, head.fuse(features))
    rounds = committed = 0
    a = prompt_len
    while a < n - 1:
        block = torch.full((1, B), head.config.mask_token_id, dtype=torch.long, device=target.device)
        block[0, 0] = text[a]
        U, hbar = head.block(own, [0], [a], block)
        chain = markov_chain(head, Block(text[a], a, U[0], hbar[0], head.config.vocab_size, head.w.draft_to_target), G)
        draft = chain.tokens[1:].tolist()
        accepted = 0
        while accepted < len(draft) and a + 1 + accepted < n and draft[accepted] == text[a + 1 + accepted]:
            accepted += 1
        step = min(accepted + 1, n - 1 - a)
        rounds, committed, a = rounds + 1, committed + step, a + step
    return rounds, committed, own
