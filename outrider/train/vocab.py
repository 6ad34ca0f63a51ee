"""The draft vocabulary of a learned head: the Vd target tokens it can propose.

As EAGLE-3 and SpecForge choose it (learned-drafters.md, section 1): the Vd target ids most
frequent among the training labels (loss-mask tokens), ties broken by the smaller id, kept sorted.
The maps written beside the head:

    used  [Vd] long   target id of draft id d, increasing
    d2t   [Vd] int64  used[d] - d (an offset: target = d + d2t[d])
    t2d   [V]  bool   true exactly on `used`

Example: V = 6, labels 4 4 1 4 1 5, Vd = 3 -> counts [0,2,0,0,3,1], used [1,4,5],
d2t [1,3,3], t2d [F,T,F,F,T,T].
"""

from __future__ import annotations

from typing import Iterable

import torch

from ..errors import ConfigError


def check_draft_vocab(draft_vocab: int, vocab_size: int) -> None:
    """One line when Vd cannot be a draft vocabulary of a target with `vocab_size` tokens."""
    if not 1 <= draft_vocab <= vocab_size:
        raise ConfigError(f"--draft-vocab must be between 1 and the target's vocabulary size {vocab_size}, "
                          f"got {draft_vocab}")


def count_labels(examples: Iterable, vocab_size: int) -> torch.Tensor:
    """[V] long: how often each target id is a label (mask true) in `examples` (data.Example)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ex in examples:
        labels = torch.tensor([t for t, m in zip(ex.tokens, ex.mask) if m], dtype=torch.long)
        counts += torch.bincount(labels, minlength=vocab_size)[:vocab_size]
    return counts


def draft_vocab(counts: torch.Tensor, draft_vocab: int) -> torch.Tensor:
    """[V] counts -> [Vd] long `used`: the top-Vd ids by count (ties: smaller id first), sorted."""
    check_draft_vocab(draft_vocab, counts.numel())
    ids = torch.arange(counts.numel())
    # a stable sort on -count keeps the smaller id first among equal counts
    order = torch.sort(-counts, stable=True).indices
    return ids[order[:draft_vocab]].sort().values


def vocab_maps(used: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """used [Vd] -> (d2t [Vd] int64, t2d [V] bool)."""
    d2t = used.long() - torch.arange(used.numel())
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used] = True
    return d2t, t2d


def used_from_maps(d2t: torch.Tensor) -> torch.Tensor:
    """The inverse of vocab_maps' first half: [Vd] target ids."""
    return torch.arange(d2t.numel()) + d2t.long()
