"""The EAGLE-3 head (issue 9, item 2): the fast forward (batched, K/V cache, tree masks) equals
the slow reference written from the spec (heads/eagle3/reference.py), over committed rows fed in
chunks and a draft tree grown one depth at a time; shared tensors are the target's own; the
stored layer ids are converted to our tap convention."""

import json

import pytest
import torch
from eagle3_tiny import write_eagle3
from tiny import make_tiny

from outrider.heads.eagle3.format import load_eagle3
from outrider.heads.eagle3.reference import reference_rows
from outrider.models.batch import pack
from outrider.weights.loader import load_decoder


@pytest.fixture(scope="module")
def target_folder(tmp_path_factory):
    return make_tiny("llama", tmp_path_factory.mktemp("e3head") / "t", vocab=40, layers=4)


@pytest.fixture(scope="module")
def target(target_folder):
    return load_decoder(target_folder, "cpu")


def head_for(target_folder, target, tmp_path, **kw):
    cfg = json.loads((target_folder / "config.json").read_text())
    return load_eagle3(write_eagle3(tmp_path / "head", cfg, **kw), target)


@pytest.mark.parametrize("kw", [dict(draft_vocab=16), dict(own_lm_head=False),
                                dict(draft_vocab=40, prefix="layers.0."),
                                dict(draft_vocab=16, config_edits={"norm_before_residual": True})])
def test_fast_forward_equals_the_reference(target_folder, target, tmp_path, kw):
    head = head_for(target_folder, target, tmp_path, seed=1, **kw)
    g = torch.Generator().manual_seed(0)
    n = 9  # committed rows 0..8: features [n, 3, H], row p gets token p + 1
    features = torch.randn(n, 3, 64, generator=g)
    tokens = torch.randint(0, 40, (n,), generator=g).tolist()
    cache = head.new_cache(1, 64)
    outs = []
    for lo, hi in ((0, 5), (5, n)):  # two catch-ups, as across rounds
        batch = pack([0], [lo], [torch.tensor(tokens[lo:hi])], scratch_row=cache.scratch_row)
        logits, hidden = head.forward(batch, cache, head.fuse(features[lo:hi]).unsqueeze(0))
        outs.append((logits[0], hidden[0]))
    logits = torch.cat([o[0] for o in outs])
    hidden = torch.cat([o[1] for o in outs])
    ref_logits, ref_hidden = reference_rows(head, list(features), tokens)
    assert torch.allclose(head.target_logits(logits).double(), ref_logits, atol=1e-4, rtol=1e-4)
    assert torch.allclose(hidden.double(), ref_hidden, atol=1e-4)

    # a draft tree on the last committed row (node 0), grown by depth: nodes 1, 2 | 3 (child of 2), 4 (of 1)
    parents, draft_tokens = [-1, 0, 0, 2, 1], [None, 5, 7, 11, 13]
    node_hidden = {0: hidden[-1]}
    node_logits = {}
    for first, nodes in ((1, [1, 2]), (3, [3, 4])):
        batch = pack([0], [n - 1], [torch.tensor([draft_tokens[i] for i in nodes])], [torch.tensor(parents)],
                     scratch_row=cache.scratch_row, first_nodes=[first])
        inputs = torch.stack([node_hidden[parents[i]] for i in nodes]).unsqueeze(0)
        lg, hd = head.forward(batch, cache, inputs)
        for j, i in enumerate(nodes):
            node_hidden[i], node_logits[i] = hd[0, j], lg[0, j]
    for leaf, path in ((3, [2, 3]), (4, [1, 4])):
        ref_l, ref_h = reference_rows(head, list(features) + [None] * len(path),
                                      tokens + [draft_tokens[i] for i in path])
        for j, i in enumerate(path):
            assert torch.allclose(head.target_logits(node_logits[i]).double(), ref_l[n + j], atol=1e-4, rtol=1e-4)
            assert torch.allclose(node_hidden[i].double(), ref_h[n + j], atol=1e-4)


def test_negative_control_a_token_off_by_one_is_caught(target_folder, target, tmp_path):
    head = head_for(target_folder, target, tmp_path, draft_vocab=16)
    features = torch.randn(4, 3, 64, generator=torch.Generator().manual_seed(1))
    tokens = [3, 4, 5, 6]
    cache = head.new_cache(1, 16)
    logits, _ = head.forward(pack([0], [0], [torch.tensor(tokens)], scratch_row=cache.scratch_row), cache,
                             head.fuse(features).unsqueeze(0))
    ref, _ = reference_rows(head, list(features), [tokens[0], *tokens[:-1]])  # row p reading token p
    assert torch.isfinite(ref[:, 1]).all()
    assert not torch.allclose(head.target_logits(logits[0]).double(), ref, atol=1e-4, rtol=1e-4)


def test_shared_tensors_are_the_targets_and_the_map_is_read(target_folder, target, tmp_path):
    shared = head_for(target_folder, target, tmp_path / "a", own_lm_head=False)
    assert shared.w.embed is target.embed and shared.w.lm_head is target.lm_head
    assert shared.w.draft_to_target is None
    reduced = head_for(target_folder, target, tmp_path / "b", draft_vocab=8)
    assert reduced.w.embed is target.embed and reduced.w.lm_head.shape == (8, 64)
    assert reduced.w.draft_to_target.tolist() == [1, 3, 5, 7, 9, 11, 13, 15]
    full = reduced.target_logits(torch.arange(8.0))
    assert full[[1, 3, 15]].tolist() == [0.0, 1.0, 7.0] and torch.isinf(full[[0, 2, 16]]).all()


@pytest.mark.parametrize("ids, semantics, taps", [(None, None, (2, 2, 1)), ([0, 1, 2], "vllm", (0, 1, 2)),
                                                  ([0, 1, 2], "sglang", (1, 2, 3)), ([1, 2, 3], None, (1, 2, 3))])
def test_layer_ids_in_our_tap_convention(target_folder, target, tmp_path, ids, semantics, taps):
    head = head_for(target_folder, target, tmp_path, layer_ids=ids, semantics=semantics)
    assert head.config.taps(target.config.num_layers) == taps  # 4 layers: default 2, N//2, N-3
