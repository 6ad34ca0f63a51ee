"""Tiny random DSpark heads for the tests (no file on disk), over tests/dflash_fixtures.random_head."""

from __future__ import annotations

import torch
from dflash_fixtures import random_head

from outrider.heads.dspark.head import DSparkConfig, DSparkHead
from outrider.heads.dspark.markov import ConfidenceHead, MarkovHead


def random_dspark_head(variant: str = "vanilla", rank: int = 8, block: int = 6, seed: int = 0, scale: float = 0.5,
                       temperatures: tuple[float, ...] = (), anchor_predicts: bool = True, **backbone) -> DSparkHead:
    """A DSpark head with random weights (its Markov output projection too, scaled by `scale`,
    so the correction is not zero); `backbone` goes to dflash_fixtures.random_head (hidden, vocab,
    layers, heads, kv_heads, taps, embed, lm_head, draft_vocab, mask_token_id)."""
    dflash = random_head(block=block, seed=seed, **backbone)
    c = dflash.config
    markov = MarkovHead(variant, rank, c.hidden_size, c.vocab_size, c.draft_vocab_size, seed=seed)
    conf = ConfidenceHead(c.hidden_size, rank, seed=seed)
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for p in list(markov.parameters()) + list(conf.parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    spec = DSparkConfig(c, variant, rank, True, tuple(temperatures), anchor_predicts)
    return DSparkHead(spec, dflash, markov.eval(), conf.eval())
