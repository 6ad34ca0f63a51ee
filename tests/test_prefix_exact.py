"""The prefix cache on by default where the CPU's rule would prefill with the float GEMM (Intel,
config gemm_prefill=auto): an engine with the cache prefills in the native layer instead
(Decoder.exact_prefill), so a prompt restored from the cache and prefilled in chunks has the bits of
the same prompt prefilled whole, and its answer is the one without the cache."""

from __future__ import annotations

import pytest
import torch

from outrider.engine.loop import EngineLoop
from outrider.engine.prefix_cache import PrefixCache
from outrider.engine.request import Request
from outrider.kernels import dispatch
from outrider.kernels.dispatch import PrefillPath
from outrider.models.batch import pack
from outrider.weights.loader import load_decoder
from cpu_profiles import INTEL_AVX512
from test_native_layer import make_family

PROMPT = [(7 * i + 3) % 90 + 3 for i in range(150)]  # past BULK_ROWS: the GEMM's rows on Intel


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_family("llama", tmp_path_factory.mktemp("prefix-exact") / "llama")


def _rows(cache, slot: int, n: int) -> list[torch.Tensor]:
    return [t[slot, :, :n].clone() for t in (*cache.k, *cache.v)]


def test_on_intel_by_default_the_cache_is_on_and_a_restored_prompt_has_the_bits_of_a_whole_prefill(folder, runtime):
    runtime(amx_prefill=False, gemm_prefill="auto")
    with dispatch.pretending(INTEL_AVX512):
        target = load_decoder(folder, "cpu", "q4")
        whole = pack([0], [0], [torch.tensor(PROMPT)], logits="none")
        assert target.prefill_path(whole) is PrefillPath.TORCH  # the rule: the float GEMM from 96 rows
        cache = PrefixCache(block=16)
        eng = EngineLoop(target, set(), None, max_running=2, max_len=256, chunk_size=40, prefix_cache=cache)
        assert eng.prefix_cache is cache and eng.prefix_cache_note is None
        assert target.prefill_path(whole) is PrefillPath.NATIVE
        first = eng.run_all([Request(list(PROMPT), 6)])[0]
        longer = PROMPT + first.token_ids + [11, 12, 13, 14, 15]
        rid = eng.add(Request(list(longer), 6))
        while not eng._seqs[rid].decoding:
            eng.step()
        seq = eng._seqs[rid]
        assert seq.cached_tokens == 144  # 9 blocks restored, the rest prefilled in chunks of 40
        restored = _rows(eng.cache, seq.slot, len(longer) - 1)
        alone = target.new_cache(1, 256)  # the same prompt in one forward, no cache
        target.forward(pack([0], [0], [torch.tensor(longer[:-1])], logits="none", scratch_row=alone.scratch_row), alone)
        assert all(torch.equal(a, b) for a, b in zip(restored, _rows(alone, 0, len(longer) - 1)))
        answer = None
        while eng.has_work:
            for event in eng.step():
                answer = event.completion if event.request_id == rid and event.completion else answer
        fresh = EngineLoop(target, set(), None, max_running=2, max_len=256, prefix_cache=PrefixCache(block=16))
        assert answer.token_ids == fresh.run_all([Request(list(longer), 6)])[0].token_ids  # nothing reused there
    runtime(gemm_prefill="on")  # asked for by name: kept, and the cache is off, saying why
    with dispatch.pretending(INTEL_AVX512):
        target = load_decoder(folder, "cpu", "q4")
        eng = EngineLoop(target, set(), None, max_running=2, max_len=256, prefix_cache=PrefixCache(block=16))
        assert eng.prefix_cache is None and "gemm_prefill=off" in eng.prefix_cache_note
        assert target.prefill_path(pack([0], [0], [torch.tensor(PROMPT)], logits="none")) is PrefillPath.TORCH
