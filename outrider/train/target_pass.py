"""The frozen target's forward for a padded batch of training sequences (no grad).

What the head trains on, computed online from one forward of the project's Decoder (no feature
dumps): the three tapped hidden states at every position, and the target's logits restricted to
the draft vocabulary. Full-vocabulary logits ([rows, V], V = 49152 on SmolLM2) exist only for
`chunk_rows` rows at a time, long enough to take their argmax and their draft-vocabulary columns.

    features      [B, T, n, Ht] float32   the head's n taps (EAGLE-3: 3), low to high
    draft_logits  [B, T, Vd]    float32   target logits at p (predicting x_{p+1}), columns `used`
    in_draft      [B, T]        bool      the target's argmax at p is a draft-vocabulary token
    valid         [B, T]        bool      p predicts a label: x_{p+1} exists and is in the loss
                                          mask, and in_draft[p]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.batch import causal_batch
from ..models.layers import linear, rms_norm


@dataclass
class TargetBatch:
    tokens: torch.Tensor  # [B, T] long (padding 0)
    features: torch.Tensor  # [B, T, 3, Ht] float32
    draft_logits: torch.Tensor  # [B, T, Vd] float32
    in_draft: torch.Tensor  # [B, T] bool
    valid: torch.Tensor  # [B, T] bool


def padded(examples: list, device="cpu") -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """data.Example list -> (tokens [B, T] long, mask [B, T] bool, lengths)."""
    lengths = [len(e.tokens) for e in examples]
    T = max(lengths)
    tokens = torch.zeros(len(examples), T, dtype=torch.long)
    mask = torch.zeros(len(examples), T, dtype=torch.bool)
    for b, e in enumerate(examples):
        tokens[b, : lengths[b]] = torch.tensor(e.tokens)
        mask[b, : lengths[b]] = torch.tensor(e.mask)
    return tokens.to(device), mask.to(device), lengths


def target_pass(target, examples: list, taps: tuple[int, ...], used: torch.Tensor,
                chunk_rows: int = 1024, logits: bool = True) -> TargetBatch:
    """Run the frozen `target` (a Decoder) over `examples` (data.Example) and keep what the head needs.

    taps: the Decoder hidden indices the head reads (the head's `taps`); used: [Vd] long sorted
    target ids. logits=False (a head trained on hard labels, DFlash): the target's output head is
    not run, nor the layers above the highest tap: draft_logits is [B, T, 0], in_draft all true."""
    device = target.device
    tokens, mask, lengths = padded(examples, device)
    B, T = tokens.shape
    N = target.config.num_layers
    depth = N if logits else max(max(taps), 1)  # without logits, the layers up to the highest tap suffice
    cache = target.new_cache(B, T, depth)  # fresh: one slot per sequence, scratch row T for padding
    wanted = set(taps) | ({N} if logits else set())
    batch = causal_batch([tokens[b, :n] for b, n in enumerate(lengths)], hidden_layers=tuple(sorted(wanted)),
                         scratch_row=cache.scratch_row, device=device)
    out = target.forward(batch, cache, num_layers=depth)
    del cache
    with torch.no_grad():  # plain tensors from here (inference tensors cannot enter autograd)
        features = torch.stack([out.hidden[t].float() for t in taps], dim=2)  # [B, T, n, Ht]
        valid = torch.zeros(B, T, dtype=torch.bool, device=device)
        valid[:, :-1] = mask[:, 1:]  # the label of p is x_{p+1}; padding is never in the mask
        if not logits:
            every = torch.ones(B, T, dtype=torch.bool, device=device)
            return TargetBatch(tokens.clone(), features.clone(), features.new_zeros(B, T, 0), every, valid)
        last = out.hidden[N].reshape(B * T, -1)  # [BT, Ht], before the final norm
        used_dev = used.to(device)
        draft, top = [], []
        for start in range(0, B * T, chunk_rows):
            rows = rms_norm(last[start:start + chunk_rows], target.norm, target.config.rms_norm_eps)
            full = linear(rows, target.lm_head).float()  # [rows, V], dropped at the end of the step
            top.append(full.argmax(-1))
            draft.append(full.index_select(-1, used_dev))
        draft_logits = torch.cat(draft).view(B, T, -1)  # [B, T, Vd]
        t2d = torch.zeros(target.config.vocab_size, dtype=torch.bool, device=device)
        t2d[used_dev] = True
        in_draft = t2d[torch.cat(top)].view(B, T)
        valid &= in_draft
        features = features.clone()
    return TargetBatch(tokens.clone(), features, draft_logits, in_draft, valid)
