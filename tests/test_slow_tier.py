"""models/slow_tier.py: DirectStore reads every expert with O_DIRECT and gives the bytes the page-cached
ExpertStore gives (per-expert tensors and fused [N, ...] slices, float32 and float16), counted alike;
PacedStore holds each read to bytes / rate (an emulated tier)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from outrider.errors import ModelError
from outrider.models.expert_store import ExpertStore
from outrider.models.slow_tier import DirectStore, PacedStore

L, N, H, I = 2, 3, 40, 24  # odd sizes: tensors start off the 4 KiB blocks


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    gen = torch.Generator().manual_seed(0)
    folder = tmp_path_factory.mktemp("tier")
    one, fused = {}, {}
    for l in range(L):
        for e in range(N):
            for proj, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
                one[f"model.layers.{l}.mlp.experts.{e}.{proj}.weight"] = torch.randn(*shape, generator=gen)
        fused[f"model.layers.{l}.mlp.experts.gate_up_proj"] = torch.randn(N, 2 * I, H, generator=gen).half()
        fused[f"model.layers.{l}.mlp.experts.down_proj"] = torch.randn(N, H, I, generator=gen).half()
    one["model.embed_tokens.weight"] = torch.randn(7, H, generator=gen)  # something before and between
    save_file(one, str(folder / "one.safetensors"))
    save_file(fused, str(folder / "fused.safetensors"))
    return folder


@pytest.mark.parametrize("name", ["one", "fused"])
def test_direct_reads_equal_page_cached_reads(files, name):
    path = files / f"{name}.safetensors"
    try:
        direct = DirectStore(path, L, N, budget=2)
    except ModelError as err:  # a file system without O_DIRECT (tmpfs): said in one line
        pytest.skip(str(err))
    page = ExpertStore(path, L, N, budget=2)
    try:
        for l in range(L):
            for e in range(N):
                a, b = direct.get(l, e), page.get(l, e)
                assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        assert direct.stats.bytes_read == page.stats.bytes_read > 0 and direct.stats.misses == page.stats.misses
    finally:
        direct.close()
        page.close()


def test_paced_reads_take_bytes_over_rate(files):
    store = PacedStore(files / "one.safetensors", L, N, budget=1, gb_per_s=0.001)  # 1 MB/s
    try:
        store.get(0, 0)
        assert store.stats.read_s >= store.stats.bytes_read / 1e6 * 0.99 and store.stats.stall_s >= store.stats.read_s * 0.99
    finally:
        store.close()
    with pytest.raises(ModelError, match="bandwidth"):
        PacedStore(files / "one.safetensors", L, N, budget=1, gb_per_s=0)
