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
