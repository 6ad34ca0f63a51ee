"""Paged K/V (models/paged_cache.py) against the slot cache: the same forwards give the same logits,
bit for bit (a whole prompt, a chunked one in a ragged batch, decode steps, random trees verified
and committed, rollback, a prefix shared by reference and then written), and the pool's pages are
held in proportion to the rows and given back."""

from __future__ import annotations

import random

import pytest
import torch

from outrider.models.batch import pack
from outrider.models.paged_cache import OutOfPages
from outrider.spec.tree import depths
from outrider.weights.loader import load_decoder

P = 4  # rows a page in these tests: many page edges in short prompts


@pytest.fixture(scope="module")
def decoder(tiny_folders):
    return load_decoder(tiny_folders["qwen3"], "cpu")


def _both(decoder, slots: int = 3, rows: int = 64, pages: int = 40):
    slot = decoder.new_cache(slots, rows)
    paged = decoder.new_cache(slots, rows, pages=pages, page_size=P)
    # pages taken and given back out of order first: a slot's pages are not consecutive
    paged.reserve(2, 5 * P)
    paged.reserve(0, 2 * P)
    paged.set_length(2, 0)
    paged.set_length(0, 0)
    paged.reserve(1, 3 * P)
    return slot, paged


def _run(decoder, caches, slots, lens, tokens, parents=None):
    """The same forward on every cache: their logits, checked equal bit for bit; returns them."""
    outs = []
    for cache in caches:
        batch = pack(slots, lens, [torch.tensor(t) for t in tokens],
                     None if parents is None else [torch.tensor(p) for p in parents], scratch_row=cache.scratch_row)
        outs.append(decoder.forward(batch, cache).logits)
    for other in outs[1:]:
        assert torch.equal(outs[0], other)
    return outs[0]


def _random_tree(rng: random.Random, n: int) -> list[int]:
    return [-1] + [rng.randrange(i) for i in range(1, n)]


def test_paged_logits_equal_the_slot_cache_through_prompts_trees_rollback_and_shared_prefixes(decoder):
    caches = _both(decoder)
    slot, paged = caches
    rng = random.Random(7)
    a = [rng.randrange(3, 96) for _ in range(13)]
    b = [rng.randrange(3, 96) for _ in range(9)]
    _run(decoder, caches, [0], [0], [a])  # a whole prompt
    _run(decoder, caches, [1, 2], [0, 0], [a[:6], b[:3]])  # chunked, ragged
    _run(decoder, caches, [2, 1], [3, 6], [b[3:], a[6:11]])  # out of order (a span with a place)
    lens = [13, 11, 9]
    for c in caches:
        for s, n in enumerate(lens):
            c.set_length(s, n)
    _run(decoder, caches, [0, 1, 2], lens, [[5], [6], [7]])  # one decode step each
    lens = [n + 1 for n in lens]
    for c in caches:
        for s, n in enumerate(lens):
            c.set_length(s, n)
    for round_ in range(6):  # random trees, verified in one forward, a random path committed
        trees = [_random_tree(rng, rng.randrange(2, 9)) for _ in range(3)]
        tokens = [[rng.randrange(3, 96) for _ in t] for t in trees]
        _run(decoder, caches, [0, 1, 2], lens, tokens, trees)
        for s, tree in enumerate(trees):
            leaf = rng.randrange(len(tree))
            path = [leaf]
            while tree[path[-1]] >= 0:
                path.append(tree[path[-1]])
            path.reverse()
            assert len(path) == int(depths(torch.tensor(tree))[leaf]) + 1
            for c in caches:
                c.compact(s, [lens[s] + i for i in path], lens[s])
                c.set_length(s, lens[s] + len(path))
            lens[s] += len(path)
        if round_ == 3:  # a rollback: two committed rows forgotten, the next forward rewrites them
            lens = [n - 2 for n in lens]
            for c in caches:
                for s, n in enumerate(lens):
                    c.set_length(s, n)
    # a prefix shared: slot 0's first rows into slot 1 (whole pages by reference), then both go on
    n = lens[0] - 3
    for c in caches:
        c.set_length(1, 0)
        c.copy_rows(0, 1, n)
        c.set_length(1, n)
    shared = paged.held[1][: n // P]
    assert shared == paged.held[0][: n // P] and all(paged.refs[p] == 2 for p in shared)
    _run(decoder, caches, [1], [n], [[9, 10, 11, 12, 13, 14]])  # writes slot 1's partial and next pages
    _run(decoder, caches, [0, 1], [lens[0], n + 6], [[20, 21], [22]])  # slot 0 still reads its own rows
    for c in caches:  # slot 1 cut back into the shared pages, then written: copy on write
        c.set_length(1, n - P - 1)
    _run(decoder, caches, [1], [n - P - 1], [[30, 31, 32]])
    _run(decoder, caches, [0], [lens[0]], [[33]])
    for c in caches:  # slot 1 gives its pages back, a new prompt takes pages: slot 0's stay its own
        c.set_length(1, 0)
    _run(decoder, caches, [1], [0], [[rng.randrange(3, 96) for _ in range(24)]])
    _run(decoder, caches, [0], [lens[0]], [[34]])


def test_pages_follow_the_rows_a_slot_holds_and_go_back(decoder):
    paged = decoder.new_cache(4, 512, pages=10, page_size=P)
    assert paged.pages_used == 0 and paged.nbytes() == 11 * paged.page_bytes()
    batch = pack([2], [0], [torch.arange(3, 12)], scratch_row=paged.scratch_row)  # 9 rows: 3 pages
    decoder.forward(batch, paged)
    assert paged.pages_used == 3 and paged.held[2] == [0, 1, 2]
    paged.set_length(2, 9)
    paged.reserve(1, 7 * P)
    assert paged.free_pages == 0
    with pytest.raises(OutOfPages, match="needs 1 more K/V pages"):
        paged.reserve(2, 13)
    assert paged.held[2] == [0, 1, 2]  # a refused reserve takes nothing
    paged.set_length(1, 0)
    assert paged.free_pages == 7 and paged.table[1].eq(paged.scratch_page).all()


def test_paged_mode_is_refused_for_state_that_is_not_plain_k_v(tmp_path):
    from tiny import make_tiny

    hybrid = load_decoder(make_tiny("qwen3_5", tmp_path / "h"), "cpu")
    with pytest.raises(ValueError, match="gated-delta layers keep a per-slot state"):
        hybrid.new_cache(2, 32, pages=8)


@pytest.mark.parametrize("family,kv", [("llama", torch.float32), ("llama-d64", torch.float16)])
def test_the_native_layer_reads_pages_in_place_with_the_slot_caches_bits(tmp_path_factory, family, kv):
    """A q4 model runs the native decoder layer: over a paged cache it reads and writes the pages in
    place through the row map, and the reference (read_in_place False) over each layer's span
    copied out; the logits of both equal the slot cache's, bit for bit: a ragged prefill, one
    slot's long prefill (the keys turned along the lanes), decode out of order over a hole, a tree,
    a prefix shared by reference then written (copy on write). float16 K/V and head size 64 (the
    several-heads path) in the second case."""
    from test_native_layer import make_family

    native = load_decoder(make_family(family, tmp_path_factory.mktemp("paged-native") / family), "cpu", "q4")
    native.kv_dtype = kv
    slot, paged = _both(native)
    _, copied = _both(native)
    copied.read_in_place = False
    caches = (slot, paged, copied)
    rng = random.Random(3)
    a, b = [rng.randrange(3, 96) for _ in range(21)], [rng.randrange(3, 96) for _ in range(11)]
    _run(native, caches, [0, 2], [0, 0], [a, b])
    _run(native, caches, [1], [0], [[rng.randrange(3, 96) for _ in range(17)]])  # >= 12 rows of one slot
    _run(native, caches, [2, 0], [11, 21], [[5], [6]])  # out of order, a hole at slot 1
    tree = _random_tree(rng, 7)
    _run(native, caches, [0], [22], [[rng.randrange(3, 96) for _ in tree]], [tree])
    _run(native, caches, [1, 2], [17, 12], [[1, 2, 3], [4]])  # padding goes to the scratch page, not to page 0
    for c in caches:  # slot 0's first 9 rows into slot 1: two pages shared, one copied
        c.set_length(0, 22)
        c.set_length(1, 0)
        c.copy_rows(0, 1, 9)
        c.set_length(1, 9)
    for c in caches[1:]:
        assert c.refs[c.held[1][0]] == 2
    _run(native, caches, [1], [9], [[7, 8, 9]])
    for c in caches:  # cut back into a shared page and written: copied first
        c.set_length(1, 6)
    _run(native, caches, [1, 0], [6, 22], [[10, 11], [12]])
    assert native._native is not None and paged.pages_used > 0 and paged.k[0].dtype == kv
    assert paged._copy is None and copied._copy is not None  # in place: no span copied
