"""The verify forward scores only real rows (models/batch.py logits="real"): on a ragged batch of
trees and chains, its flat logits are the padded forward's logits at the real rows, in slot
order, and padding gets none."""

import torch

from outrider.models.batch import pack
from outrider.weights.loader import load_decoder


def test_real_rows_are_the_padded_forwards_real_rows(tiny_folders):
    target = load_decoder(tiny_folders["llama"], "cpu")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 96, (n,), generator=g) for n in (5, 9, 3)]
    trees = [(torch.tensor([7, 8, 9, 10]), torch.tensor([-1, 0, 0, 1])), (torch.tensor([11]), None),
             (torch.tensor([12, 13]), torch.tensor([-1, 0]))]
    slots = [2, 0, 1]  # out of order: the span view with places

    def verify(logits: str):
        cache = target.new_cache(3, 32)
        target.forward(pack(slots, [0] * 3, prompts, logits="none", scratch_row=cache.scratch_row), cache)
        batch = pack(slots, [len(p) for p in prompts], [t for t, _ in trees], [p for _, p in trees],
                     logits=logits, scratch_row=cache.scratch_row)
        return target.forward(batch, cache).logits

    padded = verify("all")  # [3, 4, vocab]
    flat = verify("real")  # [4 + 1 + 2, vocab]
    sizes = [t.shape[0] for t, _ in trees]
    assert flat.shape == (sum(sizes), padded.shape[-1])
    expected = torch.cat([padded[b, :n] for b, n in enumerate(sizes)])
    assert torch.allclose(flat, expected, atol=1e-5, rtol=1e-5)
