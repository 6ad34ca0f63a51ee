"""The logits processing that depends on the tokens so far: logit bias and the repetition,
presence and frequency penalties, applied to each draft node along its own path.

The target's distribution at a node depends on every token before that node's next one: the
committed prompt and output, then the draft tokens on the path from the root down to the node
itself. Plain decoding is the root-only tree, so processing each node with its path's history
is exactly what plain decoding would do at that position, and the verifiers stay exact against
the processed distribution (speculative == plain, token for token under greedy, in law when
sampling). Semantics are vLLM's (and OpenAI's for presence/frequency):

    logits[t] += bias[t]                                   logit_bias
    logits[t]  = logits[t] / r if > 0 else logits[t] * r   t in prompt or output (repetition_penalty r)
    logits[t] -= frequency * count[t] + presence * (count[t] > 0)   count over the output

Worked example: committed output [7, 7], tree tokens [root, 3, 7] with parents [-1, 0, 1]: row 0
(the root's logits) sees counts {7: 2}; row 1 (after draft 3) sees {7: 2, 3: 1}; row 2 (after
drafts 3 then 7) sees {7: 3, 3: 1}.

`processed_reference` is the slow, obviously correct version (a Python loop per row).
"""

from __future__ import annotations

import torch

from ..sampling import SamplingParams


class PathProcessor:
    """One sequence's processing state: the prompt's tokens (for the repetition penalty) and the
    output's token counts, kept as tokens are committed."""

    def __init__(self, params: SamplingParams, prompt: list[int], vocab: int, device: torch.device | str = "cpu"):
        self.params = params
        self.vocab = vocab
        self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)  # [V] output counts
        self.in_prompt = torch.zeros(vocab, dtype=torch.bool, device=device)  # [V]
        if prompt:
            self.in_prompt[torch.tensor(prompt, device=device)] = True
        bias = torch.zeros(vocab, dtype=torch.float32, device=device)  # [V]
        if params.logit_bias:
            ids = torch.tensor([t for t, _ in params.logit_bias], device=device)
            bias[ids] = torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32, device=device)
        self.bias = bias if params.logit_bias else None

    def commit(self, tokens: list[int]) -> None:
        """These output tokens were committed (in order)."""
        if tokens:
            index = torch.tensor(tokens, device=self.counts.device)
            self.counts.index_add_(0, index, torch.ones(len(tokens), device=self.counts.device))

    def apply(self, logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
        """logits: [n, V] at the n nodes of a tree (tokens [n], parents [n], node 0 the root)
        -> processed logits [n, V] (a new tensor)."""
        n = logits.shape[0]
        out = logits.float().clone()
        if self.bias is not None:
            out += self.bias
        p = self.params
        if p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty:
            return out
        counts = self.counts.expand(n, -1).clone()  # [n, V]: the committed output's, then each path's
        rows, cols = _path_pairs(tokens.tolist(), parents.tolist())
        if rows:
            counts.index_put_((torch.tensor(rows, device=out.device), torch.tensor(cols, device=out.device)),
                              torch.ones(len(rows), device=out.device), accumulate=True)
        if p.repetition_penalty != 1.0:
            seen = self.in_prompt | (counts > 0)  # [n, V]
            scaled = torch.where(out > 0, out / p.repetition_penalty, out * p.repetition_penalty)
            out = torch.where(seen, scaled, out)
        if p.frequency_penalty:
            out -= p.frequency_penalty * counts
        if p.presence_penalty:
            out -= p.presence_penalty * (counts > 0).float()
        return out


def _path_pairs(tokens: list[int], parents: list[int]) -> tuple[list[int], list[int]]:
    """(row, token) for every draft token on each row's path from the root (the row's own
    token included, the root's excluded: it is committed already)."""
    rows, cols = [], []
    for row in range(1, len(tokens)):
        node = row
        while node > 0:
            rows.append(row)
            cols.append(tokens[node])
            node = parents[node]
    return rows, cols


def processed_reference(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int],
                        tokens: list[int], parents: list[int]) -> torch.Tensor:
    """The definition, slowly: each row's history built by walking up its path, then the rules
    of the module docstring applied token by token."""
    out = logits.double().clone()
    for row in range(len(tokens)):
        path, node = [], row
        while node > 0:
            path.append(tokens[node])
            node = parents[node]
        history = output + path[::-1]
        for token, bias in params.logit_bias:
            out[row, token] += bias
        for token in range(out.shape[1]):
            count = history.count(token)
            value = out[row, token]
            if params.repetition_penalty != 1.0 and (token in prompt or count > 0):
                value = value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
            value = value - params.frequency_penalty * count - params.presence_penalty * (count > 0)
            out[row, token] = value
    return out
