"""The trainable EAGLE-3 head (heads/eagle3/trainable.py): its training-time-test unroll computes,
for every anchor and step, exactly what the runtime head computes for the draft chain hanging off
that anchor (checked against the slow spec reference, heads/eagle3/reference.py, through an export
that the runtime loader reads back); the weights round-trip; a few optimiser steps lower the loss."""

import json

import pytest
import torch
from safetensors.torch import save_file
from tiny import make_tiny

from outrider.heads.eagle3.format import load_eagle3
from outrider.heads.eagle3.reference import reference_rows
from outrider.weights.loader import load_decoder
from outrider.heads.eagle3.trainable import Eagle3Trainable


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load_decoder(make_tiny("llama", tmp_path_factory.mktemp("e3train") / "t", vocab=40, layers=4), "cpu")


def random_head(target, used, seed=3):
    head = Eagle3Trainable.for_target(target, used, seed=seed, layer_ids=(1, 2, 2))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # weights far from their initial values, norms included
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return head


def export(head, folder):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(head.export_config()))
    save_file(head.state_tensors(), str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize("vocab", [16, 40])
def test_unroll_step_s_is_the_runtime_draft_chain(target, tmp_path, vocab):
    used = torch.arange(1, 40, 2)[:vocab] if vocab < 40 else torch.arange(40)
    head = random_head(target, used)
    runtime = load_eagle3(export(head, tmp_path / "head"), target)
    g = torch.Generator().manual_seed(1)
    T, steps, H = 8, 3, target.config.hidden_size
    features = torch.randn(1, T, 3, H, generator=g)
    tokens = torch.randint(0, 40, (1, T), generator=g)
    with torch.no_grad():
        logits = head.unroll(features, tokens, steps)  # steps x [1, T, Vd]
    for p in (0, 2, T - steps - 1):
        for s in range(steps):
            # the chain of depth s off anchor p: committed rows 0..p, then s draft rows fed their
            # parent's output hidden and the ground-truth tokens
            feats = [features[0, i] for i in range(p + 1)] + [None] * s
            toks = tokens[0, 1: p + s + 2].tolist()
            ref, _ = reference_rows(runtime, feats, toks)
            expected = ref[p + s][runtime.w.draft_to_target if vocab < 40 else torch.arange(40)]
            torch.testing.assert_close(logits[s][0, p].double(), expected, rtol=1e-4, atol=1e-4)


def test_state_tensors_round_trip_and_refuse_another_vocabulary(target):
    used = torch.arange(0, 40, 3)
    a, b = random_head(target, used, seed=1), Eagle3Trainable.for_target(target, used, seed=2)
    b.load_state_tensors(a.state_tensors())
    for x, y in zip(a.parameters(), b.parameters()):
        assert torch.equal(x, y)
    other = Eagle3Trainable.for_target(target, torch.arange(1, 40, 3), seed=2)
    with pytest.raises(ValueError, match="draft vocabulary"):
        other.load_state_tensors(a.state_tensors())


def test_a_few_steps_lower_the_ttt_loss_and_weights_decay_per_step(target):
    used = torch.arange(0, 40, 2)
    head = Eagle3Trainable.for_target(target, used, seed=0)
    g = torch.Generator().manual_seed(0)
    B, T, H = 2, 12, target.config.hidden_size
    features = torch.randn(B, T, 3, H, generator=g)
    tokens = torch.randint(0, 40, (B, T), generator=g)
    target_logits = torch.randn(B, T, used.numel(), generator=g) * 3
    valid = torch.ones(B, T, dtype=torch.bool)
    first = head.ttt(features, tokens, target_logits, valid, steps=3)
    weighted = sum(0.8 ** s * v for s, v in enumerate(first.step_loss))
    assert first.loss.item() == pytest.approx(weighted, rel=1e-5)
    assert first.rows == B * (T - 1) and len(first.step_acc) == 3
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    for _ in range(8):
        out = head.ttt(features, tokens, target_logits, valid, steps=3)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    assert out.loss.item() < first.loss.item() * 0.9
    assert head.embed.grad is None  # the target's embedding stays frozen


def test_invalid_positions_are_not_scored(target):
    used = torch.arange(0, 40, 2)
    head = Eagle3Trainable.for_target(target, used, seed=0)
    g = torch.Generator().manual_seed(0)
    features = torch.randn(1, 6, 3, target.config.hidden_size, generator=g)
    tokens = torch.randint(0, 40, (1, 6), generator=g)
    target_logits = torch.randn(1, 6, used.numel(), generator=g)
    valid = torch.tensor([[True, True, True, False, False, False]])
    out = head.ttt(features, tokens, target_logits, valid, steps=2)
    assert out.rows == 2  # step 0: rows 0 and 1 are scored against positions 1 and 2
    garbage = target_logits.clone()
    garbage[0, 3:] = 100.0  # positions that do not count change nothing
    assert head.ttt(features, tokens, garbage, valid, steps=2).loss.item() == pytest.approx(out.loss.item())


def test_calibrated_input_scale_is_folded_into_the_export(target, tmp_path):
    """fc trains on features divided by their per-dimension RMS; the exported fc.weight gives the
    same fused features from the raw ones, and a checkpoint keeps the scale for resuming."""
    used = torch.arange(0, 40, 2)
    head = random_head(target, used)
    g = torch.Generator().manual_seed(5)
    scale = torch.rand(3 * target.config.hidden_size, generator=g) * 1000 + 1  # dimensions of very unequal size
    features = torch.randn(2, 6, 3, target.config.hidden_size, generator=g) * scale.view(3, -1)
    tokens = torch.randint(0, 40, (2, 6), generator=g)
    head.calibrate(features)
    assert not torch.allclose(head.feature_scale, torch.ones_like(head.feature_scale))
    with torch.no_grad():
        before = head.unroll(features, tokens, 2)
    runtime = load_eagle3(export(head, tmp_path / "h"), target)
    ref, _ = reference_rows(runtime, [features[0, i] for i in range(3)], tokens[0, 1:4].tolist())
    torch.testing.assert_close(before[0][0, 2].double(), ref[2][runtime.w.draft_to_target], rtol=1e-4, atol=1e-4)
    resumed = Eagle3Trainable.for_target(target, used, seed=9)
    resumed.load_state_tensors(head.state_tensors(training=True))
    with torch.no_grad():
        torch.testing.assert_close(resumed.unroll(features, tokens, 2)[1], before[1])
