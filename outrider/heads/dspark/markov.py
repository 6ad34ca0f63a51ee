"""DSpark's sequential head: a rank-r correction of each block position's logits by the token
drafted just before it, and the confidence head reading the same features.

DeepSpec's DSpark (the paper's section on the sequential head; deepseek-ai/DeepSpec
`deepspec/modeling/dspark/qwen3/modeling.py`, read through the file index). Shapes: H the head's
hidden size, V the target vocabulary, Vd the draft vocabulary (the backbone's readout), r the rank.
The backbone gives, for block position k (1..gamma), base logits U_k [Vd] and its last hidden
state h_k [H] (after the final norm). With x_0 the anchor (the last committed token) and x_{k-1}
the token drafted at position k-1 (a target id):

    e_k     = W1[x_{k-1}]                                        [r]   (`prev_embed`, [V, r])
    vanilla bias_k = W2 e_k                                      [Vd]  (`out_proj`, [Vd, r])
    gated   bias_k = W2 (sigmoid(Wg [h_k; e_k]) * e_k)                 (`gate_proj`, [r, H + r])
    rnn     z = [s_{k-1}; e_k; h_k]        s_0 = 0                      [2r + H]
            u = sigmoid(Wg z); s_k = u * s_{k-1} + (1 - u) * tanh(Wc z)  (`gate_proj`, `cand_proj`: [r, 2r + H])
            bias_k = W2 tanh(Wo z)                                      (`mix_proj`, [r, 2r + H])
    logits  p_k(v | x_0, x_<k) = softmax(U_k + bias_k)
    confidence  c_k = sigmoid((w . [h_k; e_k] + b) / T_k)        (`ConfidenceHead`; T_k the
                                                                  per-position temperature, 1 untrained)

Drafting runs left to right (each step a rank-r update); training (teacher forcing) feeds the
true previous tokens, so the vanilla and gated heads take the whole block at once (`block_bias`),
the rnn head a loop over positions. `out_proj` starts at zero: an untrained head is the backbone.

The API other drafters build on (PCTree scores each child per concrete parent with `step`):

    head = MarkovHead(variant, rank, hidden_size, vocab_size, draft_vocab_size, seed=0)
    state = head.initial_state(N)                           [N, r] (zeros; only the rnn reads it)
    bias, state = head.step(prev [N] long, hidden [N, H], state [N, r])   bias [N, Vd]
    logits = U_k + bias                                     the position's corrected logits [N, Vd]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

VARIANTS = ("vanilla", "gated", "rnn")


def _param(rows: int, cols: int, gen: torch.Generator, std: float) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.randn(rows, cols, generator=gen) * std)


class MarkovHead(torch.nn.Module):
    """W1 (`prev_embed`, [V, r]) read by target id; W2 (`out_proj`, [Vd, r]); the gated and rnn
    variants' projections (module docstring). Parameters are plain tensors named as in the
    DSpark checkpoint (`markov_head.` + the attribute name + `.weight`)."""

    def __init__(self, variant: str, rank: int, hidden_size: int, vocab_size: int, draft_vocab_size: int | None = None,
                 *, seed: int = 0, std: float = 0.02):
        super().__init__()
        if variant not in VARIANTS:
            raise ValueError(f"markov head variant {variant!r}: use one of {', '.join(VARIANTS)}")
        if rank < 1:
            raise ValueError(f"markov head rank must be at least 1, got {rank}")
        self.variant, self.rank, self.hidden_size = variant, rank, hidden_size
        Vd = draft_vocab_size or vocab_size
        gen = torch.Generator().manual_seed(seed)
        H, r = hidden_size, rank
        self.prev_embed = torch.nn.Module()
        self.prev_embed.weight = _param(vocab_size, r, gen, r ** -0.5)  # [V, r]: rows of norm ~1, so that
        # out_proj (from zero) moves the logits within a few steps (at std 0.02 it did not in 16)
        self.out_proj = torch.nn.Module()
        self.out_proj.weight = torch.nn.Parameter(torch.zeros(Vd, r))  # [Vd, r]: starts as no correction
        width = {"vanilla": 0, "gated": H + r, "rnn": 2 * r + H}[variant]
        names = {"vanilla": (), "gated": ("gate_proj",), "rnn": ("gate_proj", "cand_proj", "mix_proj")}[variant]
        for name in names:
            module = torch.nn.Module()
            module.weight = _param(r, width, gen, std)  # [r, width]
            setattr(self, name, module)

    # -- the pieces ------------------------------------------------------------------------------
    def prev_embeddings(self, prev: torch.Tensor) -> torch.Tensor:
        """prev [...] long target ids -> e [..., r]."""
        return F.embedding(prev, self.prev_embed.weight)

    def initial_state(self, n: int) -> torch.Tensor:
        """s_0 for n chains [n, r] (zeros)."""
        w = self.prev_embed.weight
        return w.new_zeros(n, self.rank)

    def step(self, prev: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None = None):
        """One position for N rows: prev [N] long (x_{k-1}, target ids), hidden [N, H] (h_k),
        state [N, r] (s_{k-1}; None: s_0) -> (bias [N, Vd], s_k [N, r])."""
        e = self.prev_embeddings(prev).to(hidden.dtype)  # [N, r]
        if state is None:
            state = e.new_zeros(e.shape[0], self.rank)
        if self.variant == "vanilla":
            return F.linear(e, self.out_proj.weight.to(e.dtype)), state
        if self.variant == "gated":
            g = torch.sigmoid(F.linear(torch.cat((hidden, e), -1), self.gate_proj.weight.to(e.dtype)))  # [N, r]
            return F.linear(g * e, self.out_proj.weight.to(e.dtype)), state
        z = torch.cat((state.to(e.dtype), e, hidden), -1)  # [N, 2r + H]
        u = torch.sigmoid(F.linear(z, self.gate_proj.weight.to(e.dtype)))  # [N, r]
        new = u * state.to(e.dtype) + (1 - u) * torch.tanh(F.linear(z, self.cand_proj.weight.to(e.dtype)))
        bias = F.linear(torch.tanh(F.linear(z, self.mix_proj.weight.to(e.dtype))), self.out_proj.weight.to(e.dtype))
        return bias, new

    def block_bias(self, prev: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Teacher-forced: prev [..., G] long (x_0..x_{G-1}), hidden [..., G, H] -> bias [..., G, Vd]
        of positions 1..G. The vanilla and gated heads in one product; the rnn head position by position."""
        if self.variant != "rnn":
            lead = prev.shape
            bias, _ = self.step(prev.reshape(-1), hidden.reshape(-1, hidden.shape[-1]))
            return bias.view(*lead, -1)
        G = prev.shape[-1]
        flat_prev = prev.reshape(-1, G)  # [N, G]
        flat_hidden = hidden.reshape(-1, G, hidden.shape[-1])  # [N, G, H]
        state, out = None, []
        for k in range(G):
            bias, state = self.step(flat_prev[:, k], flat_hidden[:, k], state)
            out.append(bias)
        return torch.stack(out, 1).view(*prev.shape, -1)


class ConfidenceHead(torch.nn.Module):
    """c_k = sigmoid((w . [h_k; e_k] + b) / T_k): `proj` ([1, H + r] and [1], DeepSpec's
    `confidence_head.proj`); the temperatures live in the head's config (calibrate.py fits them)."""

    def __init__(self, hidden_size: int, rank: int, *, seed: int = 0, std: float = 0.02):
        super().__init__()
        gen = torch.Generator().manual_seed(seed + 1)
        self.proj = torch.nn.Module()
        self.proj.weight = _param(1, hidden_size + rank, gen, std)  # [1, H + r]
        self.proj.bias = torch.nn.Parameter(torch.zeros(1))  # [1]

    def logit(self, hidden: torch.Tensor, prev_embedding: torch.Tensor) -> torch.Tensor:
        """hidden [..., H], prev_embedding [..., r] -> the uncalibrated logit [...] (float32)."""
        x = torch.cat((hidden, prev_embedding.to(hidden.dtype)), -1)
        return F.linear(x, self.proj.weight.to(x.dtype), self.proj.bias.to(x.dtype)).squeeze(-1).float()
