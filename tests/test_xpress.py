"""xPress (drafters/refiners/xpress.py, xpress_head.py; train/xpress.py): the fast head against the
written-out reference, causality, Jacobi's fixed point, greedy speculation equal to plain."""

from __future__ import annotations

import pytest
import torch
from dflash_fixtures import random_head
from enumerate_law import one_thread

from outrider.drafters.block import Block
from outrider.drafters.refiners import make_refiner, parse_refiners
from outrider.drafters.refiners.xpress import (XPress, jacobi, parse, reference_jacobi, sequential)
from outrider.drafters.refiners.xpress_head import XPressHead, XPressWeights, reference_logits
from outrider.errors import ConfigError, ModelError

B, H, V, R = 6, 32, 64, 8


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    with one_thread():
        yield


def random_weights(seed=1, scale=1.0, block=B, hidden=H) -> XPressWeights:
    """Trained-looking weights: every tensor random (the mixer and up_o too, unlike init's zeros)."""
    g = torch.Generator().manual_seed(seed)
    w = XPressWeights.init(hidden, R, block, seed)
    t = {k: v + torch.randn(v.shape, generator=g) * 0.5 * scale for k, v in w.tensors().items()}
    t["up_o"] = torch.randn(hidden, R, generator=g) * scale
    return XPressWeights(**t)


@pytest.fixture(scope="module")
def head():
    return random_head(hidden=H, vocab=V, block=B, seed=2, mask_token_id=1)


def block_of(head, seed=0, committed=(7, 9)):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, H, generator=g) * 2
    logits = torch.randn(B - 1, V, generator=g)
    return Block(committed[-1], len(committed) - 1, logits, hidden, V, committed=list(committed))


def test_the_fast_head_equals_the_reference_and_untrained_refines_nothing(head):
    w = random_weights()
    x = XPressHead(w, head)
    blk = block_of(head)
    prev = [3, 7, 9, 11, 2, 5]
    fast = x.logits(blk.hidden.unsqueeze(0), torch.tensor([prev]))[0]
    torch.testing.assert_close(fast, reference_logits(w, head, blk.hidden, prev), atol=2e-3, rtol=1e-4)
    # a prefix of the slots gives the same rows (the refiner computes only the round's depth)
    hn, c = x.features(blk.hidden.unsqueeze(0))
    torch.testing.assert_close(x.logits_from(hn, c, torch.tensor([prev[:4]]))[0], fast[:3], atol=1e-4, rtol=1e-5)
    # init: up_o = 0, L = 0: refined = the block head's own logits (lm_head(norm(h)))
    base = XPressHead(XPressWeights.init(H, R, B), head).logits(blk.hidden.unsqueeze(0), torch.tensor([prev]))[0]
    own = torch.nn.functional.linear(torch.nn.functional.rms_norm(blk.hidden[1:], (H,), head.w.norm, 1e-6),
                                     head.w.lm_head)
    torch.testing.assert_close(base, own, atol=1e-4, rtol=1e-5)


def test_a_later_token_never_changes_an_earlier_slot(head):
    x = XPressHead(random_weights(), head)
    blk = block_of(head)
    prev = torch.tensor([[3, 7, 9, 11, 2, 5]])
    out = x.logits(blk.hidden.unsqueeze(0), prev)[0]  # [B-1, V]
    for j in range(2, B):  # prev_j feeds slot j and later: slots 1..j-1 unchanged, slot j moves
        moved = prev.clone()
        moved[0, j] = (moved[0, j] + 13) % V
        got = x.logits(blk.hidden.unsqueeze(0), moved)[0]
        torch.testing.assert_close(got[: j - 1], out[: j - 1], atol=0, rtol=0)
        assert not torch.allclose(got[j - 1], out[j - 1])
    # the reference agrees: a non-causal mixer (the full L, not its triangle) would fail this
    w = random_weights()
    ref = reference_logits(w, head, blk.hidden, [3, 7, 9, 11, 2, 5])
    ref2 = reference_logits(w, head, blk.hidden, [3, 7, 9, 11, 2, 60])
    torch.testing.assert_close(ref[:4], ref2[:4], atol=0, rtol=0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_jacobi_reaches_the_sequential_decode_and_equals_the_reference(head, seed):
    w = random_weights(seed=seed, scale=2.0)
    x = XPressHead(w, head)
    blk = block_of(head, seed=seed)
    K = B - 1
    seq = sequential(w, head, blk, K, mask_token=1)
    for passes in range(K + 2):
        fast, ran = jacobi(x, blk, K, passes, mask_token=1)
        assert fast == reference_jacobi(w, head, blk, K, passes, mask_token=1)
        assert fast[:passes] == seq[:passes]  # after p passes the first p slots are decided
        assert ran <= passes
    assert jacobi(x, blk, K, K, 1)[0] == seq  # K passes: the fixed point
    # the fixed point is one: a pass over the sequential decode changes nothing
    again = reference_logits(w, head, blk.hidden, [7, 9, *seq[:-1]]).argmax(-1).tolist()
    assert again == seq
    # depth-limited: the first d slots, computed on d+1 slots only
    assert jacobi(x, blk, 3, 2, 1)[0] == reference_jacobi(w, head, blk, 3, 2, 1)


def test_zero_passes_is_the_blocks_own_argmax_and_the_proposal_is_a_chain(head):
    x = XPress(XPressHead(random_weights(), head), passes=0)
    blk = block_of(head)
    from outrider.drafters.block import greedy_chain

    tree = x.refine(blk, greedy_chain(blk, 3), depth=4, nodes=3, greedy=True)
    assert tree.tokens.tolist() == [9, *blk.argmax(3)]
    assert tree.parents.tolist() == [-1, 0, 1, 2]
    one = XPress(XPressHead(random_weights(), head), passes=1).refine(blk, tree, 4, 8, False)
    assert one.tokens.numel() == 5 and one.tokens[1:].tolist() != blk.argmax(4)


def test_parse_and_refusals(tmp_path, head):
    assert parse("") == ("", 2) and parse("3") == ("", 3) and parse("/a/b.safetensors:0") == ("/a/b.safetensors", 0)
    assert parse("/a/b") == ("/a/b", 2)
    with pytest.raises(ConfigError, match="passes must be"):
        parse("99")
    with pytest.raises(ConfigError, match="xpress needs its head"):
        make_refiner("xpress:1", head, tmp_path)
    with pytest.raises(ModelError, match="not found"):
        make_refiner(f"xpress:{tmp_path / 'none.safetensors'}:1", head)
    random_weights(block=B + 1).save(tmp_path / "wrong")
    with pytest.raises(ConfigError, match="block size"):
        make_refiner(f"xpress:{tmp_path / 'wrong'}", head)
    random_weights().save(tmp_path)
    r = make_refiner("xpress:3", head, tmp_path)  # found beside the head
    assert r.passes == 3 and r.cost.forwards == 3 and parse_refiners("ddtree+xpress:1") == ("ddtree", "xpress:1")


# -- end to end on a tiny target (greedy speculation equals plain) -------------------------------------

@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from tiny import make_tiny

    from outrider.weights.loader import load_decoder

    folder = make_tiny("llama", tmp_path_factory.mktemp("xpress") / "t", vocab=8, layers=4)
    return load_decoder(folder, "cpu")


def _tiny_head(target):
    return random_head(hidden=64, vocab=8, layers=2, heads=4, kv_heads=2, block=5, taps=3, seed=3,
                       embed=target.embed, lm_head=target.lm_head, mask_token_id=0)


@pytest.mark.parametrize("passes", [0, 1, 3])
def test_greedy_speculation_with_xpress_equals_plain(target, tmp_path_factory, passes):
    from test_dflash_spec import run

    from outrider.control.controllers import FixedController
    from outrider.drafters.dflash import DFlashDrafter
    from outrider.engine.speculator import SpecOptions, Speculator
    from outrider.spec.shapes import parse_shape

    h = _tiny_head(target)
    folder = tmp_path_factory.mktemp("xw")
    random_weights(seed=4, scale=2.0, block=5, hidden=64).save(folder)
    shape = parse_shape("ddtree:6")
    refiner = make_refiner(f"xpress:{passes}", h, folder)
    drafter = DFlashDrafter(h, shape, h.config.taps(target.config.num_layers), (refiner,))
    spec = Speculator(SpecOptions("dflash:x", "ddtree:6", "fixed:4"), drafter, FixedController(4), shape)
    assert run(target, spec) == run(target, None)
    from outrider.sampling import SamplingParams

    params = SamplingParams(temperature=1.0, seed=5)  # the deterministic chain under the tree walk
    assert run(target, spec, params) == run(target, None, params)


def test_training_lowers_the_loss_and_learns_a_rule_jacobi_then_follows(target):
    from outrider.train.xpress import train

    h = _tiny_head(target)
    seqs = [[(i * 3 + j) % 8 for j in range(24)] for i in range(6)]  # x_{t+1} = x_t + 1 mod 8
    lines = []
    w = train(h, target, seqs, steps=120, rank=8, anchors=12, batch=16, lr=3e-2, labels="text", weight_decay=0.01,
              keep_best=True, log=lines.append)
    losses = [float(l.split("loss ")[1].split()[0]) for l in lines if l.startswith("step")]
    assert losses[-1] < 0.5 * losses[0]
    assert any(l.startswith("kept step ") for l in lines)  # the best held-out check's weights
    # the trained head from a block of a new sequence: Jacobi's chain is the rule's continuation
    x = XPressHead(w, h)
    ids = [5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0]
    from outrider.train.xpress import target_view

    with torch.inference_mode():
        feats, _ = target_view(target, ids, h.config.taps(target.config.num_layers))
        cache = h.new_cache(1, len(ids))
        h.write_context(cache, 0, 0, h.fuse(feats))
        toks = torch.full((1, 5), 0, dtype=torch.long)
        toks[0, 0] = ids[4]
        logits, hidden = h.block(cache, [0], [4], toks)
    blk = Block(ids[4], 4, logits[0], hidden[0], 8, committed=ids[:5])
    assert jacobi(x, blk, 4, 4, 0)[0] == [2, 3, 4, 5]


def test_target_labels_are_the_targets_greedy_tokens(target):
    """On the target's own greedy text, the `target` labels (its argmax after each prefix) are the
    text's next tokens: an off-by-one in either kind of label breaks this."""
    import random

    from outrider.engine.generate import generate_ids
    from outrider.engine.request import Request
    from outrider.train.xpress import collect

    h = _tiny_head(target)
    ids = [2] + list(generate_ids(target, [Request([2], 16)], set())[0].token_ids)  # greedy from one token
    got = [collect(h, target, [ids], 6, 100, random.Random(0), labels, log=lambda *_: None)
           for labels in ("target", "text")]
    assert torch.equal(got[0][2], got[1][2])
    assert torch.equal(got[0][1], got[1][1])  # the same blocks, predecessors the text's
    assert len(set(ids)) > 2 and got[0][2].shape == (6, 4)


def test_a_reduced_readout_maps_ids_both_ways():
    """A head reading out a draft vocabulary (dflash:NAME,vocab=N): Jacobi's chain in target ids
    equals the reference's, and training labels map to draft ids and back."""
    from outrider.heads.vocab_map import to_draft_ids, to_target_ids

    m = torch.tensor([0, 2, 3, 5, 7, 11, 13, 40, 63])
    h = random_head(hidden=H, vocab=V, block=B, seed=5, mask_token_id=1, draft_vocab=m)
    w = random_weights(seed=6, scale=2.0)
    g = torch.Generator().manual_seed(3)
    blk = Block(9, 1, torch.randn(B - 1, m.numel(), generator=g), torch.randn(B, H, generator=g) * 2, V, m,
                committed=[7, 9])
    chain, _ = jacobi(XPressHead(w, h), blk, B - 1, 3, 1)
    assert chain == reference_jacobi(w, h, blk, B - 1, 3, 1) and set(chain) <= set(m.tolist())
    d, kept = to_draft_ids(m, torch.tensor([40, 4, 0, 63]), V)
    assert kept.tolist() == [True, False, True, True] and to_target_ids(m, d[kept]).tolist() == [40, 0, 63]
