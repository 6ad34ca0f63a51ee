"""Attention's register tiles for many rows of one slot (csrc/attention_lanes.h): from LANES_ROWS rows
a forward's keys are turned along the lanes once and its scores computed in tiles of 3 query heads
by 3 blocks of 8 keys; the weighted values (AVX2 builds) take 3 heads at once. Each score and output
element must get the one-row path's operations in its order, so a prefill whole, in chunks or a row
at a time, a chain verified at once or a token a step, and a tree's node against its path decoded
a token a step, are the same bits: on every variant this machine executes, with a float32 and a
float16 cache, for 3 and 6 query heads a K/V head (whole tiles and what is left)."""

from __future__ import annotations

import re

import pytest
import torch

from outrider.kernels import native
from outrider.kernels.native_build import CSRC
from outrider.models.batch import pack
from outrider.weights.loader import load_decoder
from test_native_layer import make_family
from kernel_variants import ALL, variant  # noqa: F401  (variant: the fixture)

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernel: {native.reason()}")

LANES_ROWS = int(re.search(r"#define LANES_ROWS (\d+)", (CSRC / "attention_lanes.h").read_text()).group(1))
PROMPT = [3, 9, 4, 11, 7, 8, 20, 5, 17, 30] * 4 + [6, 2]  # 42 rows: 5 blocks of 8 and a part
CHAIN = [12, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52]
PARENTS = [-1, 0, 0, 1, 2, 3, 1, 4, 4, 6, 7, 5, 9, 11]  # 14 nodes, branching
assert len(CHAIN) >= LANES_ROWS and len(PROMPT) >= LANES_ROWS and len(PARENTS) == len(CHAIN)


@pytest.fixture(scope="module", params=["llama-g3", "llama-g6"])  # head size 32, and 64
def folder(request, tmp_path_factory):
    return make_family(request.param, tmp_path_factory.mktemp("lanes") / request.param)


@pytest.fixture(scope="module")
def loaded(folder):
    """The family's q4 model, loaded once (a load was most of each test's time). What a forward
    depends on is set per test: the config (read at each forward, kernels/dispatch.py), the variant
    (native.library() at each call) and the cache's type (read by new_cache)."""
    return load_decoder(folder, "cpu", "q4")


@pytest.fixture(params=["float32", "float16"])
def model(request, loaded, runtime):
    runtime(amx_prefill=False, gemm_prefill="off")  # the prefill in the native layer
    loaded.kv_dtype = getattr(torch, request.param)
    return loaded


def feed(m, cache, start: int, tokens, parents=None, logits="all"):
    return m.forward(pack([0], [start], [torch.tensor(tokens)], None if parents is None else [torch.tensor(parents)],
                          logits=logits, scratch_row=cache.scratch_row), cache).logits


def prefilled(m, chunks):
    cache = m.new_cache(1, 64)
    start = 0
    for size in chunks:
        feed(m, cache, start, PROMPT[start:start + size], logits="none")
        start += size
    return cache


@pytest.mark.parametrize("variant", ALL, indirect=True)
def test_a_prefill_whole_chunked_or_a_row_at_a_time_is_the_same_bits(model, variant):
    for chunks in ([LANES_ROWS, 5, len(PROMPT) - LANES_ROWS - 5], [1] * len(PROMPT)):
        whole, other = prefilled(model, [len(PROMPT)]), prefilled(model, chunks)
        for layer in range(len(model.layers)):
            assert torch.equal(other.k[layer], whole.k[layer]) and torch.equal(other.v[layer], whole.v[layer]), chunks
        assert torch.equal(feed(model, other, len(PROMPT), [12]), feed(model, whole, len(PROMPT), [12])), chunks


@pytest.mark.parametrize("variant", ALL, indirect=True)
def test_a_chain_verified_at_once_gets_what_a_token_a_step_gets(model, variant):
    cache = prefilled(model, [len(PROMPT)])
    together = feed(model, cache, len(PROMPT), CHAIN)[0]
    cache = prefilled(model, [len(PROMPT)])
    for i, t in enumerate(CHAIN):
        assert torch.equal(feed(model, cache, len(PROMPT) + i, [t])[0, 0], together[i]), i


@pytest.mark.parametrize("variant", ALL, indirect=True)
def test_a_tree_node_gets_what_its_path_gets_a_token_a_step(model, variant):
    cache = prefilled(model, [len(PROMPT)])
    tree = feed(model, cache, len(PROMPT), CHAIN, PARENTS)[0]
    for node in range(len(CHAIN)):
        path, j = [], node
        while j >= 0:
            path.insert(0, j)
            j = PARENTS[j]
        cache = prefilled(model, [len(PROMPT)])
        for depth, k in enumerate(path):
            step = feed(model, cache, len(PROMPT) + depth, [CHAIN[k]])[0, -1]
        assert torch.equal(step, tree[node]), (node, path)
