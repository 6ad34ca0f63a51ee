"""The native layer's scores option (attention.c outrider_attention_mass; SparseSpec-L's selection):
the attention weights each verified row gave each key, per layer and K/V head, summed over the
rows and the K/V head's query heads, equal what torch computes from the same rows' queries
(sparsespec_select.query_mass) to float tolerance, for ragged batches, padding and tree masks; the
forward's logits, taps and cache are the same bits with the option and without; and SparseSpec-L
drafting from these scores keeps greedy output equal to autoregressive. On every variant of the
library this machine executes (kernel_variants.py; the greedy test on the default and portable)."""

from __future__ import annotations

import pytest
import torch

from outrider.drafters.sparsespec import SparseDrafter
from outrider.drafters.sparsespec_select import queries, query_mass
from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.kernels import native
from outrider.models.batch import pack
from outrider.sampling import SamplingParams
from outrider.weights.loader import load_decoder
from kernel_variants import ALL, TWO, variant  # noqa: F401  (variant: the fixture)
from test_native_layer import make_family

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernel: {native.reason()}")
PROMPTS = {0: [3, 9, 4, 11, 7, 8, 20, 5, 6, 30], 2: [6, 5, 30, 31]}


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model(request, tmp_path_factory):
    folder = make_family(request.param, tmp_path_factory.mktemp("scores") / request.param)
    return load_decoder(folder, "cpu", "q4"), folder


def verify(m, attention: bool, taps: bool):
    """Two prompts prefilled, then one forward of a tree (slot 2, 3 rows, padded to 4) beside a
    chain (slot 0): its output, batch and cache."""
    cache = m.new_cache(3, 64)
    for slot, toks in PROMPTS.items():
        m.forward(pack([slot], [0], [torch.tensor(toks)], logits="none", scratch_row=cache.scratch_row), cache)
    batch = pack([2, 0], [4, 10], [torch.tensor([13, 14, 15]), torch.tensor([16, 17, 18, 19])],
                 [torch.tensor([-1, 0, 0]), None], logits="real", scratch_row=cache.scratch_row,
                 hidden_layers=tuple(range(len(m.layers))) if taps else ())
    return m.forward(batch, cache, attention=attention), batch, cache


@pytest.mark.parametrize("variant", ALL, indirect=True)
def test_the_scores_equal_torchs_from_the_same_queries(model, variant):
    m, _ = model
    out, batch, cache = verify(m, True, taps=True)
    assert m._native is not None and out.attention.shape == (2, len(m.layers), m.config.num_kv_heads, batch.kv_len)
    for b, (slot, n) in enumerate([(2, 3), (0, 4)]):
        for layer in range(len(m.layers)):
            q = queries(m, layer, out.hidden[layer][b, :n], batch.positions[b, :n])  # [H, n, D]
            want = query_mass(q, cache.k[layer][slot, :, :batch.kv_len], batch.attn_mask[b, 0, :n])  # [G, L]
            assert torch.allclose(out.attention[b, layer], want, rtol=1e-5, atol=1e-6), (b, layer)
    groups = m.config.num_heads // m.config.num_kv_heads  # each row's weights sum to 1 a query head
    assert torch.allclose(out.attention.sum(-1)[0], torch.full((len(m.layers), m.config.num_kv_heads), 3.0 * groups))


@pytest.mark.parametrize("variant", ALL, indirect=True)
def test_the_forward_is_the_same_bits_with_the_scores_or_without(model, variant):
    """Logits and cache equal bit for bit with the option and without, one native call for all layers
    (no taps) or one a layer (taps); and the scores equal between the two."""
    m, _ = model
    plain, _, cache_plain = verify(m, False, taps=False)
    scored, _, cache_scored = verify(m, True, taps=False)
    tapped, _, _ = verify(m, True, taps=True)
    assert plain.attention is None and torch.equal(plain.logits, scored.logits)
    assert torch.equal(scored.logits, tapped.logits) and torch.equal(scored.attention, tapped.attention)
    for layer in range(len(m.layers)):
        assert torch.equal(cache_plain.k[layer], cache_scored.k[layer])
        assert torch.equal(cache_plain.v[layer], cache_scored.v[layer])


@pytest.mark.parametrize("variant", TWO, indirect=True)
def test_sparsespec_from_the_native_scores_equals_autoregressive(model, variant, monkeypatch):
    m, folder = model
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 96, (50,), generator=g).tolist(), [10, 11, 12, 13, 14] * 12]
    requests = [Request(p, 16, SamplingParams(0.0)) for p in prompts]
    plain = [f.token_ids for f in generate_ids(m, requests, set())]
    seen = []
    observe = SparseDrafter.observe_attention
    monkeypatch.setattr(SparseDrafter, "observe_attention",
                        lambda self, ids, scores: (seen.extend(scores), observe(self, ids, scores))[1])
    for shape in ("chain", "dynamic:3,8"):
        spec = Speculator.build(SpecOptions("sparsespec:12,2,3", shape, "fixed:4"), m, folder)
        assert spec.drafter.native_scores and spec.attention and spec.hidden_layers == ()  # no taps: one call
        fast = generate_ids(m, requests, set(), speculation=spec)
        assert [f.token_ids for f in fast] == plain
        assert max(spec.drafter.kept_share) < 0.25  # sparsity applied
        assert sum(f.round_stats.committed for f in fast) > sum(f.round_stats.rounds for f in fast)  # drafts accepted
    assert seen and all(s is not None for s in seen)
