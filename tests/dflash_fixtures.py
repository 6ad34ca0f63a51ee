"""Tiny random DFlash heads for the tests (no file on disk)."""

from __future__ import annotations

import torch

from outrider.heads.dflash.head import DFlashConfig, DFlashHead, DFlashLayer, DFlashWeights


def random_head(hidden: int = 32, target_hidden: int | None = None, vocab: int = 64, layers: int = 2,
                heads: int = 4, kv_heads: int = 2, block: int = 6, taps: int = 2, seed: int = 0,
                embed: torch.Tensor | None = None, lm_head: torch.Tensor | None = None,
                draft_vocab: torch.Tensor | None = None, mask_token_id: int = 1) -> DFlashHead:
    """A head with random weights; `embed`/`lm_head` the target's when given (shared, as at run
    time); `draft_vocab` [Vd] target ids of a reduced vocabulary (its own lm_head rows)."""
    g = torch.Generator().manual_seed(seed)
    ht = target_hidden or hidden
    d = hidden // heads
    inter = 2 * hidden

    def r(*shape, scale=0.3):
        return torch.randn(*shape, generator=g) * scale

    def ones(n):
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    config = DFlashConfig(hidden, ht, vocab, layers, heads, kv_heads, d, inter, 1e-6, 10000.0, block,
                          mask_token_id, target_layer_ids=tuple(range(taps)),
                          draft_vocab_size=None if draft_vocab is None else int(draft_vocab.numel()))
    layer_list = [DFlashLayer(ones(hidden), r(heads * d, hidden), r(kv_heads * d, hidden), r(kv_heads * d, hidden),
                              ones(d), ones(d), r(hidden, heads * d), ones(hidden), r(2 * inter, hidden),
                              r(hidden, inter)) for _ in range(layers)]
    embed = embed if embed is not None else r(vocab, hidden, scale=1.0)
    if draft_vocab is not None:
        head_rows = r(int(draft_vocab.numel()), hidden, scale=1.0)
    else:
        head_rows = lm_head if lm_head is not None else r(vocab, hidden, scale=1.0)
    weights = DFlashWeights(r(hidden, taps * ht), ones(hidden), layer_list, ones(hidden), head_rows, embed,
                            draft_to_target=draft_vocab)
    return DFlashHead(config, weights)
