"""`outrider train dflash` (issue 27) on a tiny random target: the training model's block logits
are the runtime head's (heads/dflash/head.py `block`) and the slow reference's for every anchor, through
an export the loader reads back; a block never sees another block nor its own anchor's future;
a few steps lower the loss; a resumed run ends with the same tensors as an uninterrupted one;
bad options are one-line errors."""

import random

import pytest
import torch
from safetensors.torch import load_file
from tiny import make_tiny
from train_common import SEQ, corpus, log_of, options, target, words, write_jsonl  # noqa: F401 (fixtures)

from outrider.cli import main
from outrider.heads.dflash.format import load_dflash, runtime_weights
from outrider.heads.dflash.head import DFlashHead
from outrider.heads.dflash.reference import reference_block
from outrider.heads.dflash.trainable import DFlashTrainable
from outrider.train.loop import train
from outrider.train.target_pass import target_pass
from outrider.train.data import Example
from outrider.weights.loader import load_decoder


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    return load_decoder(make_tiny("llama", tmp_path_factory.mktemp("dftrain") / "t", vocab=40, layers=4), "cpu")


def random_head(decoder, used, seed=3, block=5, layers=2):
    head = DFlashTrainable.for_target(decoder, used, seed=seed, layers=layers, block_size=block, mask_token_id=1,
                                      layer_ids=(0, 2))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # weights far from their initial values, norms included
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    head.feature_scale.copy_(0.5 + torch.rand(head.feature_scale.shape, generator=g))  # folded on export
    return head


@pytest.mark.parametrize("vocab", [16, 40])
def test_block_logits_are_the_runtime_heads_and_the_references(decoder, vocab):
    used = torch.arange(40)[torch.randperm(40, generator=torch.Generator().manual_seed(1))[:vocab]].sort().values
    head = random_head(decoder, used)
    tokens = torch.randint(3, 40, (2, 14), generator=torch.Generator().manual_seed(2))
    tb = target_pass(decoder, [Example(t.tolist(), [True] * 14) for t in tokens], head.taps(4), used, logits=False)
    anchors = torch.tensor([[0, 3, 9], [1, 6, 13]])
    with torch.no_grad():
        train_logits = head.block_logits(tb.features, tokens, anchors)  # [2, 3, 4, Vd]
    runtime = DFlashHead(head.config, runtime_weights(head.state_tensors(), head.config, decoder))
    cache = runtime.new_cache(2, 20)
    for s in range(2):
        cache_rows = runtime.fuse(tb.features[s])  # [14, H]
        runtime.write_context(cache, s, 0, cache_rows)
    for i in range(3):
        blocks = torch.stack([torch.tensor([int(tokens[s, anchors[s, i]])] + [1] * 4) for s in range(2)])
        fast, _ = runtime.block(cache, [0, 1], anchors[:, i].tolist(), blocks)  # [2, 4, Vd]
        for s in range(2):
            a = int(anchors[s, i])
            slow = reference_block(runtime, tb.features[s, :a], blocks[s])
            torch.testing.assert_close(train_logits[s, i], slow, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(fast[s], slow, rtol=1e-4, atol=1e-4)


def test_a_block_sees_its_context_and_itself_only(decoder):
    used = torch.arange(40)
    head = random_head(decoder, used)
    tokens = torch.randint(3, 40, (1, 14), generator=torch.Generator().manual_seed(4))
    tb = target_pass(decoder, [Example(tokens[0].tolist(), [True] * 14)], head.taps(4), used, logits=False)
    anchors = torch.tensor([[2, 5, 8]])
    with torch.no_grad():
        base = head.block_logits(tb.features, tokens, anchors)
        later = tb.features.clone()
        later[:, 5:] += 10.0  # the context at and after anchor 5: block 1 (anchor 5) must not change
        changed = head.block_logits(later, tokens, anchors)
        moved = head.block_logits(tb.features, tokens, torch.tensor([[2, 5, 9]]))  # another block moves
    torch.testing.assert_close(changed[0, :2], base[0, :2])
    assert not torch.allclose(changed[0, 2], base[0, 2])
    torch.testing.assert_close(moved[0, :2], base[0, :2])


def test_a_few_steps_lower_the_loss_and_log_per_slot_accuracy(target, tmp_path):
    one = write_jsonl(tmp_path / "one.jsonl", [{"text": words(random.Random(5), SEQ)}])
    train(options(target, one, tmp_path / "out", steps=8, lr=3e-3, warmup_steps=0, head="dflash", block_size=4,
                  anchors=8, draft_vocab=None), log=lambda m: None)
    log = log_of(tmp_path / "out")
    assert log[-1]["loss"] < log[0]["loss"] - 0.2, [r["loss"] for r in log]
    assert len(log[-1]["step_acc"]) == 3 and 0 <= log[-1]["accepted"] <= 3
    head = load_dflash(tmp_path / "out", load_decoder(target, "cpu"))
    assert head.config.block_size == 4 and head.config.mask_token_id == 95  # no spare special token: the last id


def test_resume_matches_an_uninterrupted_run(target, corpus, tmp_path):
    kw = dict(head="dflash", block_size=4, anchors=4, draft_vocab=24, layers=1)
    whole = tmp_path / "whole"
    train(options(target, corpus, whole, **kw), log=lambda m: None)

    class Stop(Exception):
        pass

    def stop_at_2(record):
        if record["step"] == 2:
            raise Stop

    part = tmp_path / "part"
    with pytest.raises(Stop):
        train(options(target, corpus, part, **kw), log=lambda m: None, on_step=stop_at_2)
    train(options(target, corpus, part, resume=True, **kw), log=lambda m: None)
    a, b = load_file(str(whole / "model.safetensors")), load_file(str(part / "model.safetensors"))
    assert a.keys() == b.keys() and "lm_head.weight" in a and "d2t" in a
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert log_of(whole) == [{**r, "elapsed_s": w["elapsed_s"]} for r, w in zip(log_of(part), log_of(whole))]


@pytest.mark.parametrize("argv, message", [
    (["--block-size", "1"], "--block-size must be an integer >= 2"),
    (["--anchors", "0"], "--anchors must be an integer >= 1"),
    (["--gamma", "0"], "--gamma must be a positive number"),
    (["--target-layers", "1,x"], "expected comma-separated integers"),
])
def test_bad_options_are_one_line_errors(target, corpus, tmp_path, capsys, argv, message):
    code = main(["train", "dflash", "--target", str(target), "--data", f"jsonl:{corpus}", "--out",
                 str(tmp_path / "o"), *argv]) if "x" not in argv[-1] else None
    if code is None:
        with pytest.raises(SystemExit):
            main(["train", "dflash", "--target", str(target), "--data", f"jsonl:{corpus}", "--out",
                  str(tmp_path / "o"), *argv])
    else:
        assert code != 0
    err = capsys.readouterr().err
    assert message in err


def test_torchrun_two_processes_match_one_when_every_position_is_an_anchor(target, tmp_path):
    """With more --anchors than positions every label position is an anchor whatever the generator
    draws, so the global batch 4 split 2 + 2 over two gloo processes must equal one process: the
    ranks weight each slot by the global count of its labels."""
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    rng = random.Random(3)
    texts = write_jsonl(tmp_path / "texts.jsonl", [{"text": words(rng, rng.choice((6, 11, 17, SEQ)))}
                                                   for _ in range(16)])
    args = ["train", "dflash", "--target", str(target), "--data", f"jsonl:{texts}", "--steps", "3",
            "--seq-len", str(SEQ), "--batch-size", "4", "--block-size", "4", "--anchors", "64",
            "--no-progress", "--threads", "1"]
    assert main(args + ["--out", str(tmp_path / "one")]) == 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).parents[1]))
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                          "--master_addr", "127.0.0.1", "--master_port", str(port),
                          "-m", "outrider.cli", *args, "--out", str(tmp_path / "two")],
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    a, b = load_file(str(tmp_path / "one" / "model.safetensors")), load_file(str(tmp_path / "two" / "model.safetensors"))
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5, msg=k)
    assert [r["loss"] for r in log_of(tmp_path / "two")] == pytest.approx([r["loss"] for r in log_of(tmp_path / "one")],
                                                                        rel=1e-4)
