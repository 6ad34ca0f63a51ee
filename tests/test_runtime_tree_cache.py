"""Trees, rollback, compaction and ragged batches against plain sequential forwards."""

import pytest
import torch

from outrider.models.batch import pack
from outrider.weights.loader import load_decoder
from outrider.spec.tree import leaf_paths


def forward(decoder, cache, slot_lens, tokens, parents=None):
    slots = list(range(len(tokens))) if len(slot_lens) > 1 else [0]
    batch = pack(slots, slot_lens, tokens, parents, scratch_row=cache.scratch_row)
    return decoder.forward(batch, cache).logits


def sequential_logits(decoder, tokens):
    """Logits of a plain causal forward over `tokens` from an empty cache: [n, vocab]."""
    cache = decoder.new_cache(1, 64)
    return forward(decoder, cache, [0], [torch.tensor(tokens)])[0]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_tree_forward_equals_sequential_along_every_path(tiny_folders, kind):
    decoder = load_decoder(tiny_folders[kind], "cpu")
    prefix = [11, 12, 13, 14, 15]
    parents = [-1, 0, 0, 1, 1, 2, 3, 0, 7]
    tree_tokens = [15, 21, 22, 23, 24, 25, 26, 27, 28]  # node 0 is the root = the last prefix token
    cache = decoder.new_cache(1, 64)
    forward(decoder, cache, [0], [torch.tensor(prefix[:-1])])
    tree_logits = forward(decoder, cache, [len(prefix) - 1], [torch.tensor(tree_tokens)],
                          [torch.tensor(parents)])[0]  # [n, vocab]
    for path in leaf_paths(parents):
        seq = prefix[:-1] + [tree_tokens[i] for i in path]
        expected = sequential_logits(decoder, seq)[len(prefix) - 1:]
        torch.testing.assert_close(tree_logits[path], expected, atol=1e-4, rtol=1e-4)


def test_rollback_and_compaction_equal_recompute(tiny_folders):
    decoder = load_decoder(tiny_folders["qwen2"], "cpu")
    prefix = [3, 4, 5, 6]
    parents = [-1, 0, 0, 2, 2, 4]
    tree_tokens = [6, 40, 41, 42, 43, 44]
    cache = decoder.new_cache(1, 64)
    forward(decoder, cache, [0], [torch.tensor(prefix[:-1])])
    length = len(prefix) - 1
    forward(decoder, cache, [length], [torch.tensor(tree_tokens)], [torch.tensor(parents)])
    accepted = [0, 2, 4, 5]  # not contiguous: rows length+0, +2, +4, +5
    cache.compact(0, [length + i for i in accepted], length)
    cache.set_length(0, length + len(accepted))
    committed = prefix[:-1] + [tree_tokens[i] for i in accepted]
    nxt = [50, 51, 52]
    got = forward(decoder, cache, [len(committed)], [torch.tensor(nxt)])[0]
    expected = sequential_logits(decoder, committed + nxt)[len(committed):]
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    # plain rollback: forget the last two committed rows and continue from there
    cache.set_length(0, len(committed) - 2)
    got = forward(decoder, cache, [len(committed) - 2], [torch.tensor([60, 61])])[0]
    expected = sequential_logits(decoder, committed[:-2] + [60, 61])[len(committed) - 2:]
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_ragged_batch_equals_each_alone(tiny_folders):
    decoder = load_decoder(tiny_folders["llama"], "cpu")
    prompts = [[7, 8, 9, 10, 11, 12, 13], [20, 21], [30, 31, 32, 33]]
    cache = decoder.new_cache(3, 64)
    prefill = forward(decoder, cache, [0, 0, 0], [torch.tensor(p) for p in prompts])
    for b, p in enumerate(prompts):
        torch.testing.assert_close(prefill[b, : len(p)], sequential_logits(decoder, p), atol=1e-4, rtol=1e-4)
        cache.set_length(b, len(p))
    # next round: different sizes per slot, one slot with a tree, slots in a shuffled order
    news = {0: [14], 1: [22, 23, 24], 2: [34, 35]}
    parents = {0: None, 1: torch.tensor([-1, 0, 0]), 2: None}
    order = [2, 0, 1]
    batch = pack(order, [len(prompts[s]) for s in order], [torch.tensor(news[s]) for s in order],
                 [parents[s] for s in order], scratch_row=cache.scratch_row)
    logits = decoder.forward(batch, cache).logits
    for b, s in enumerate(order):
        n = len(news[s])
        if parents[s] is None:
            expected = sequential_logits(decoder, prompts[s] + news[s])[len(prompts[s]):]
            torch.testing.assert_close(logits[b, :n], expected, atol=1e-4, rtol=1e-4)
        else:  # siblings 23 and 24 both follow 22
            for node in (1, 2):
                expected = sequential_logits(decoder, prompts[s] + [22, news[s][node]])[-1]
                torch.testing.assert_close(logits[b, node], expected, atol=1e-4, rtol=1e-4)


def test_early_exit_runs_only_the_first_layers(tiny_folders):
    decoder = load_decoder(tiny_folders["llama"], "cpu")
    tokens = torch.tensor([5, 6, 7, 8])
    cache = decoder.new_cache(1, 16, num_layers=1)
    got = decoder.forward(pack([0], [0], [tokens], scratch_row=cache.scratch_row), cache, num_layers=1).logits
    full = decoder.new_cache(1, 16)
    hidden = decoder.forward(pack([0], [0], [tokens], hidden_layers=(1,), scratch_row=16), full).hidden[1]
    from outrider.models.layers import rms_norm
    expected = torch.nn.functional.linear(rms_norm(hidden, decoder.norm, decoder.config.rms_norm_eps), decoder.lm_head)
    torch.testing.assert_close(got, expected)


# -- KVCache itself, row by row (models/kv_cache.py): what rollback and compaction rest on ----------

def numbered_cache(layers=2, slots=3, max_len=8, dtype=torch.float32):
    """A KVCache whose every element holds a distinct number: k of (layer, slot, head, row, dim)
    is 10000 * layer + 1000 * slot + 100 * row + 10 * head + dim, v the same plus 0.5."""
    from outrider.models.kv_cache import KVCache

    cache = KVCache(layers, slots, max_len, 2, 3, dtype, "cpu")
    for layer in range(layers):
        idx = torch.meshgrid(*(torch.arange(n) for n in cache.k[layer].shape), indexing="ij")
        number = 10000 * layer + 1000 * idx[0] + 100 * idx[2] + 10 * idx[1] + idx[3]
        cache.k[layer].copy_(number)
        cache.v[layer].copy_(number + 0.5)
    return cache


def test_a_new_cache_is_zeros_of_the_asked_shape():
    from outrider.models.kv_cache import KVCache

    cache = KVCache(3, 2, 5, 4, 6, torch.float16, "cpu")
    assert len(cache.k) == len(cache.v) == 3 and cache.k[0] is not cache.k[1] and cache.k[0] is not cache.v[0]
    for t in (*cache.k, *cache.v):
        assert t.shape == (2, 4, 6, 6) and t.dtype == torch.float16 and t.device.type == "cpu"
        assert not t.any()  # zeros: a masked row is multiplied by a zero weight, and 0 * NaN is NaN
    assert (cache.max_len, cache.scratch_row, cache.lengths, cache.num_slots) == (5, 5, [0, 0], 2)
    cache.set_length(1, 3)
    assert (cache.free_rows(0), cache.free_rows(1)) == (5, 2)


def test_set_length_takes_zero_to_max_len_and_refuses_the_rest():
    cache = numbered_cache(max_len=8)
    before = [t.clone() for t in (*cache.k, *cache.v)]
    for length in (0, 8, 3):
        cache.set_length(2, length)
        assert cache.lengths == [0, 0, length]
    for bad in (-1, 9):
        with pytest.raises(ValueError) as err:
            cache.set_length(1, bad)
        assert str(err.value) == f"slot 1: length {bad} outside [0, 8]"
    assert cache.lengths == [0, 0, 3]  # a refused length changes nothing, rows included
    assert all(torch.equal(a, b) for a, b in zip(before, (*cache.k, *cache.v)))


@pytest.mark.parametrize("src, dst", [([10, 12, 15], 10), ([3, 4, 6, 7], 3), ([5, 9], 2), ([4, 5, 6], 4)])
def test_compact_moves_exactly_the_accepted_rows(src, dst):
    """Rows src[i] land at dst + i in every layer's k and v of that slot; every other row, and
    the other slots, keep what they held (a chain, already in place, moves nothing)."""
    cache = numbered_cache(max_len=16)
    before = [t.clone() for t in (*cache.k, *cache.v)]
    cache.compact(1, src, dst)
    for old, new in zip(before, (*cache.k, *cache.v)):
        expected = old.clone()
        expected[1, :, dst: dst + len(src)] = old[1, :, src]
        assert torch.equal(new, expected)


def test_compact_in_place_costs_nothing(monkeypatch):
    cache = numbered_cache()
    monkeypatch.setattr(torch.Tensor, "index_copy_", lambda *a, **k: pytest.fail("a chain moved rows"))
    cache.compact(0, [4, 5, 6], 4)


def test_copy_rows_copies_a_prompt_into_another_slot():
    """copy_rows(src, dst, n): rows 0..n-1 of every layer's k and v; row n on, and the source, unchanged."""
    cache = numbered_cache(slots=3, max_len=8)
    before = [t.clone() for t in (*cache.k, *cache.v)]
    cache.copy_rows(2, 0, 5)
    for old, new in zip(before, (*cache.k, *cache.v)):
        expected = old.clone()
        expected[0, :, :5] = old[2, :, :5]
        assert torch.equal(new, expected)


def test_ensure_capacity_doubles_and_keeps_what_is_stored():
    cache = numbered_cache(layers=2, slots=3, max_len=6, dtype=torch.float64)  # 3 slots, 2 heads: not mixed up
    cache.set_length(1, 4)
    before = [t.clone() for t in (*cache.k, *cache.v)]
    same = list(cache.k)
    cache.ensure_capacity(6)  # fits: nothing changes, not even the tensors
    assert cache.max_len == 6 and all(a is b for a, b in zip(cache.k, same))
    cache.ensure_capacity(7)  # doubles: 12 rows, the scratch row after them
    assert (cache.max_len, cache.scratch_row, cache.lengths, cache.free_rows(1)) == (12, 12, [0, 4, 0], 8)
    for old, new in zip(before, (*cache.k, *cache.v)):
        assert new.shape == (3, 2, 13, 3) and new.dtype == torch.float64
        assert torch.equal(new[:, :, :6], old[:, :, :6]) and not new[:, :, 6:].any()  # the old scratch row not kept
    cache.ensure_capacity(30)  # more than double: exactly what was asked
    assert (cache.max_len, cache.scratch_row) == (30, 30)
    for old, new in zip(before, (*cache.k, *cache.v)):
        assert new.shape == (3, 2, 31, 3) and torch.equal(new[:, :, :6], old[:, :, :6]) and not new[:, :, 6:].any()
