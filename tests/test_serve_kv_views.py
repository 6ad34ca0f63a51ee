"""Slots that come and go: a batch with holes reads the K/V cache as a view, never a gathered copy."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from outrider.models.batch import pack
from outrider.weights.loader import load_decoder

GATHERS = {"aten.index.Tensor", "aten.index_select.default", "aten.gather.default"}


class CacheReads(TorchDispatchMode):
    """Records every gathering op whose input is one of the cache's tensors."""

    def __init__(self, cache):
        super().__init__()
        self.storages = {t.untyped_storage().data_ptr() for t in (*cache.k, *cache.v)}
        self.gathers: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        first = args[0] if args else None
        if (str(func) in GATHERS and isinstance(first, torch.Tensor)
                and first.untyped_storage().data_ptr() in self.storages):
            self.gathers.append(str(func))
        return func(*args, **(kwargs or {}))


def _alone(decoder, prompt, new):
    cache = decoder.new_cache(1, 32)
    decoder.forward(pack([0], [0], [torch.tensor(prompt)], scratch_row=cache.scratch_row), cache)
    cache.set_length(0, len(prompt))
    return decoder.forward(pack([0], [len(prompt)], [torch.tensor(new)], scratch_row=cache.scratch_row), cache).logits[0]


def test_batch_with_holes_equals_each_alone_without_gathering_the_cache(tiny_folders):
    decoder = load_decoder(tiny_folders["qwen2"], "cpu")
    prompts = {3: [5, 6, 7, 8], 0: [9, 10], 2: [11, 12, 13]}  # slot 1 is a hole; slots out of order
    news = {3: [20], 0: [21, 22], 2: [23]}
    cache = decoder.new_cache(4, 32)
    order = [3, 0, 2]
    decoder.forward(pack(order, [0] * 3, [torch.tensor(prompts[s]) for s in order], logits="none",
                         scratch_row=cache.scratch_row), cache)
    for s in order:
        cache.set_length(s, len(prompts[s]))
    batch = pack(order, [len(prompts[s]) for s in order], [torch.tensor(news[s]) for s in order],
                 scratch_row=cache.scratch_row)
    assert (batch.span_first, batch.span_size) == (0, 4)
    with CacheReads(cache) as reads:
        logits = decoder.forward(batch, cache).logits
    assert reads.gathers == [], f"the forward gathered the K/V cache: {reads.gathers}"
    for b, s in enumerate(order):
        expected = _alone(decoder, prompts[s], news[s])
        torch.testing.assert_close(logits[b, : len(news[s])], expected, atol=1e-4, rtol=1e-4)


def test_hole_rows_leave_other_slots_untouched(tiny_folders):
    """The hole's slot is not written (its K/V stays what it was)."""
    decoder = load_decoder(tiny_folders["llama"], "cpu")
    cache = decoder.new_cache(3, 16)
    for layer in cache.k:
        layer[1].fill_(7.0)
    decoder.forward(pack([0, 2], [0, 0], [torch.tensor([4, 5]), torch.tensor([6])],
                         scratch_row=cache.scratch_row), cache)
    assert all(bool((layer[1] == 7.0).all()) for layer in cache.k)
