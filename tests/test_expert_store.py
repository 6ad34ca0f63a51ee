"""The expert store (models/expert_store.py, issue 41 item 3): LRU eviction order, bytes counted as
stored, prefetch on a hint, both file layouts, and a MoE layer through the store equal to the same
layer with every expert resident, whatever the budget."""

import pytest
import torch
from safetensors.torch import save_file

from outrider.errors import ModelError
from outrider.models.expert_store import ExpertStore, ResidentExperts
from outrider.models.moe_config import MoeConfig
from outrider.models.moe_layer import MoeWeights, moe_mlp

L, N, H, I = 2, 4, 8, 4  # layers, experts, hidden, expert size


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    g = torch.Generator().manual_seed(0)
    w = {(l, e): (torch.randn(2 * I, H, generator=g), torch.randn(H, I, generator=g)) for l in range(L) for e in range(N)}
    root = tmp_path_factory.mktemp("experts")
    per, fused = {}, {}
    for l in range(L):
        for e in range(N):
            p = f"model.layers.{l}.mlp.experts.{e}."
            per[p + "gate_proj.weight"], per[p + "up_proj.weight"] = w[l, e][0][:I].clone(), w[l, e][0][I:].clone()
            per[p + "down_proj.weight"] = w[l, e][1]
        fused[f"model.layers.{l}.mlp.experts.gate_up_proj"] = torch.stack([w[l, e][0] for e in range(N)])
        fused[f"model.layers.{l}.mlp.experts.down_proj"] = torch.stack([w[l, e][1] for e in range(N)])
    save_file(per, str(root / "per.safetensors"))
    save_file(fused, str(root / "fused.safetensors"))
    return w, root / "per.safetensors", root / "fused.safetensors"


EXPERT_BYTES = (2 * I * H + H * I) * 4  # one expert's float32 gate, up and down


def test_lru_evicts_least_recently_used_and_counts_bytes(files):
    _, per, _ = files
    s = ExpertStore(per, L, N, budget=2)
    for key in [(0, 0), (0, 1), (0, 0), (0, 2), (1, 3), (0, 2)]:
        s.get(*key)
    # (0,1) left when (0,2) came (least recent: (0,0) was used again); then (0,0) left for (1,3)
    assert s.resident() == [(1, 3), (0, 2)]
    st = s.stats
    assert (st.uses, st.hits, st.misses, st.evictions) == (6, 2, 4, 2)
    assert st.bytes_read == 4 * EXPERT_BYTES
    assert st.read_s > 0 and st.stall_s > 0
    s.close()


@pytest.mark.parametrize("layout", [1, 2])
def test_values_and_bytes_in_both_layouts(files, layout):
    w, *paths = files
    s = ExpertStore(paths[layout - 1], L, N, budget=1)
    gate_up, down = s.get(1, 2)
    assert torch.equal(gate_up, w[1, 2][0]) and torch.equal(down, w[1, 2][1])
    assert s.stats.bytes_read == EXPERT_BYTES  # a fused file's slice reads only that expert
    s.close()


def test_prefetch_is_a_hit_when_it_finished(files):
    w, per, _ = files
    s = ExpertStore(per, L, N, budget=3)
    s.prefetch([(1, 0), (1, 1)])
    s.wait()
    assert s.stats.bytes_read == 2 * EXPERT_BYTES and s.stats.prefetched == 2
    assert torch.equal(s.get(1, 1)[1], w[1, 1][1])
    assert (s.stats.hits, s.stats.misses, s.stats.prefetch_used) == (1, 0, 1)
    s.prefetch([(1, 1)])  # already resident: nothing read
    assert s.stats.prefetched == 2
    s.close()


def test_bad_input_refused(files):
    _, per, _ = files
    with pytest.raises(ModelError, match="budget"):
        ExpertStore(per, L, N, budget=0)
    with pytest.raises(ModelError, match="no expert tensor"):
        ExpertStore(per, L, N, budget=1, prefix="model.layers.{layer}.moe.experts")
    s = ExpertStore(per, L, N, budget=1)
    with pytest.raises(ModelError, match="outside"):
        s.get(0, N)
    s.close()


@pytest.mark.parametrize("budget", [1, 3, L * N])
def test_moe_layer_through_the_store_equals_resident(files, budget):
    _, per, _ = files
    cfg = MoeConfig(num_experts=N, top_k=2, expert_size=I, norm_topk_prob=True)
    g = torch.Generator().manual_seed(1)
    router = torch.randn(N, H, generator=g)
    x = torch.randn(1, 9, H, generator=g)  # [B, T, H]
    ref = ResidentExperts(per, L, N)
    store = ExpertStore(per, L, N, budget)
    for layer in range(L):
        want = moe_mlp(MoeWeights(router, *ref.layer(layer)), cfg, x)
        got = moe_mlp(MoeWeights(router, *store.layer(layer)), cfg, x)
        assert torch.equal(got, want)
    chosen = {e for e in torch.topk(x.reshape(-1, H) @ router.T, 2).indices.flatten().tolist()}
    st = store.stats
    assert st.uses == L * len(chosen)  # each chosen expert used once a layer, down not recounted
    assert st.misses == st.uses and st.bytes_read == st.uses * EXPERT_BYTES  # every (layer, expert) new
    store.close()
