"""Fast paths of the layer arithmetic against their plain torch references."""

import pytest
import torch
import torch.nn.functional as F

from outrider.models.layers import linear, rms_norm


@pytest.mark.parametrize("rows", [1, 2, 3, 7])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_equals_f_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(1, rows, 64, generator=g)
    w = torch.randn(96, 64, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    torch.testing.assert_close(linear(x, w, b), F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    assert linear(x, w, b).shape == (1, rows, 96)


def test_rms_norm_fused_equals_reference():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 64, generator=g)
    w = torch.randn(64, generator=g)
    reference = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(rms_norm(x, w, 1e-5), reference)
    torch.testing.assert_close(rms_norm(x.double(), w.double(), 1e-5), reference.double(), atol=1e-6, rtol=1e-6)


def test_attention_with_folded_mask_is_the_same():
    """The float mask folded once per forward gives exactly what the bool mask gives."""
    from outrider.models.layers import attention, fold_mask

    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 6, 4, 16, generator=g)
    k, v = torch.randn(2, 2, 9, 16, generator=g), torch.randn(2, 2, 9, 16, generator=g)
    mask = torch.rand(2, 1, 4, 9, generator=g) > 0.4
    mask[..., 0] = True
    folded = fold_mask(mask, 3, q.dtype)
    assert torch.equal(attention(q, k, v, mask, folded), attention(q, k, v, mask))
    reference = F.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), attn_mask=mask)
    torch.testing.assert_close(attention(q, k, v, mask, folded), reference)


@pytest.mark.parametrize("lengths", [[5], [3, 7, 1], [4, 4]])
def test_causal_batch_is_packs_batch(lengths):
    """models/batch.causal_batch (a training batch built on the device) equals pack's, field by field."""
    from outrider.models.batch import causal_batch, pack

    gen = torch.Generator().manual_seed(len(lengths))
    seqs = [torch.randint(0, 50, (n,), generator=gen) for n in lengths]
    want = pack(list(range(len(seqs))), [0] * len(seqs), seqs, logits="none", hidden_layers=(1, 3), scratch_row=9)
    got = causal_batch(seqs, hidden_layers=(1, 3), scratch_row=9)
    for name in ("slot_ids", "kv_len", "hidden_layers", "span_first", "span_size", "span_place", "logits_flat"):
        assert getattr(got, name) == getattr(want, name), name
    for name in ("tokens", "positions", "rows", "logits_rows"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert (got.attn_mask is None) == (want.attn_mask is None)
    if want.attn_mask is not None:
        assert torch.equal(got.attn_mask, want.attn_mask)
    assert got.fills_only and want.fills_only


@pytest.mark.parametrize("cache_len", [0, 6])
@pytest.mark.parametrize("n", [1, 4])
@pytest.mark.parametrize("tree", [None, "chain"])
@pytest.mark.parametrize("logits", ["all", "real", "last", "none"])
def test_one_slot_causal_batch_is_the_general_batch(cache_len, n, tree, logits):
    """pack's shortcut for one slot of causal tokens (a decode step, a chain's verify, a prompt)
    gives _pack's batch field for field; a tree that is not a chain takes _pack itself."""
    from outrider.models.batch import _pack, pack

    tokens = [torch.arange(10, 10 + n)]
    parents = None if tree is None else [torch.arange(-1, n - 1)]
    got, want = pack([3], [cache_len], tokens, parents, logits, hidden_layers=(2,), scratch_row=9), \
        _pack([3], [cache_len], tokens, parents, logits, (2,), 9, "cpu", None)
    for name in ("slot_ids", "kv_len", "hidden_layers", "span_first", "span_size", "span_place"):
        assert getattr(got, name) == getattr(want, name), name
    for name in ("tokens", "positions", "rows", "logits_rows", "logits_flat", "attn_mask"):
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None) and (a is None or (a.dtype == b.dtype and torch.equal(a, b))), name
    forked = [torch.tensor([-1, 0, 0])]  # not a chain
    assert torch.equal(pack([0], [5], [torch.tensor([1, 2, 3])], forked).attn_mask,
                       _pack([0], [5], [torch.tensor([1, 2, 3])], forked, "all", (), -1, "cpu", None).attn_mask)
