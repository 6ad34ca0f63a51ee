"""`outrider train eagle3` (issue 9, item 3) on a tiny random target and word-level tokenizer:
training lowers the loss on a fixed batch; a resumed run ends with the same tensors as an
uninterrupted one; the exported head loads (heads/eagle3/format.py) and drafts with greedy
speculative == autoregressive; regeneration commits what generation commits and carries over;
bad arguments are one-line errors before any loading; two torchrun processes (gloo) match one.
The data sources, their order and batches: tests/test_train_data.py."""

import json
import os
import random
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from train_common import SEQ, corpus, log_of, options, target, words, write_jsonl  # noqa: F401 (fixtures)

from outrider.cli import main
from outrider.errors import ConfigError
from outrider.heads.eagle3.format import load_eagle3
from outrider.weights.loader import load_decoder
from outrider.train.loop import train

def test_loss_falls_on_a_fixed_batch(target, tmp_path):
    one = write_jsonl(tmp_path / "one.jsonl", [{"text": words(random.Random(5), SEQ)}])
    train(options(target, one, tmp_path / "out", steps=8, lr=3e-3, warmup_steps=0, ttt_steps=2), log=lambda m: None)
    log = log_of(tmp_path / "out")
    assert [r["step"] for r in log] == list(range(1, 9)) and log[-1]["tokens"] == 8 * 2 * SEQ
    assert log[-1]["loss"] < log[0]["loss"] - 0.2, [r["loss"] for r in log]  # soft CE: the floor is the target's entropy (no step: constant)


def test_resume_matches_an_uninterrupted_run(target, corpus, tmp_path):
    whole = tmp_path / "whole"
    train(options(target, corpus, whole), log=lambda m: None)

    class Stop(Exception):
        pass

    def stop_at_3(record):
        if record["step"] == 3:  # after the step-2 checkpoint, in the middle of step 3's work
            raise Stop

    cut = tmp_path / "cut"
    with pytest.raises(Stop):
        train(options(target, corpus, cut), log=lambda m: None, on_step=stop_at_3)
    assert json.loads((cut / "checkpoint" / "state.json").read_text())["step"] == 2
    train(options(target, corpus, cut, resume=True), log=lambda m: None)
    a, b = load_file(str(whole / "model.safetensors")), load_file(str(cut / "model.safetensors"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [r["loss"] for r in log_of(whole)] == [r["loss"] for r in log_of(cut)]
    # the optimizer state continued too (a fresh AdamW would give other tensors): checked by equality above
    info = json.loads((cut / "train_info.json").read_text())
    assert info["steps"] == 4 and info["final_step_acc"] == log_of(whole)[-1]["step_acc"]


def test_same_seed_reproduces_other_seed_differs(target, corpus, tmp_path):
    runs = {}
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        train(options(target, corpus, tmp_path / name, steps=2, seed=seed), log=lambda m: None)
        runs[name] = load_file(str(tmp_path / name / "model.safetensors"))
    assert all(torch.equal(runs["a"][k], runs["b"][k]) for k in runs["a"])
    assert not torch.equal(runs["a"]["fc.weight"], runs["c"]["fc.weight"])


def test_export_loads_and_drafts_losslessly(target, corpus, tmp_path):
    from outrider.llm import LLM

    out = tmp_path / "head"
    train(options(target, corpus, out, steps=2), log=lambda m: None)
    head = load_eagle3(out, load_decoder(target, "cpu"))
    assert head.config.draft_vocab_size == 48 and head.w.draft_to_target.shape == (48,)
    prompts = [words(random.Random(i), 6) for i in range(3)]
    plain = LLM(str(target)).generate(prompts, 12)
    spec = LLM(str(target), drafter=f"eagle3:{out}", controller="fixed:3").generate(prompts, 12)
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    assert sum(c.stats["drafted"] for c in spec) > 0  # the head really drafted


def test_greedy_batch_commits_what_generate_ids_commits(target):
    from outrider.engine.generate import generate_ids
    from outrider.engine.request import Request
    from outrider.sampling import SamplingParams
    from outrider.train.regenerate import greedy_batch

    decoder = load_decoder(target, "cpu")
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 96) for _ in range(n)] for n in (1, 5, 9, 3)]
    limits = [6, 11, 2, 9]
    no_eos = greedy_batch(decoder, prompts, limits, set())
    assert [len(g) for g in no_eos] == limits  # without end tokens every response runs to its limit
    eos = {no_eos[0][2], no_eos[3][4]}  # tokens the greedy runs do produce: some responses end early
    want = [f.token_ids for f in generate_ids(decoder, [Request(p, m, SamplingParams(0.0))
                                                        for p, m in zip(prompts, limits)], eos)]
    got = greedy_batch(decoder, prompts, limits, eos)
    assert got == want
    assert len(got[0]) <= 3 and len(got[3]) <= 5 and all(a[:len(b)] == b for a, b in zip(no_eos, got))


def test_regenerate_then_a_time_budget_plans_the_steps_and_responses_carry_over(target, tmp_path):
    from outrider.train import loop

    rng = random.Random(4)
    rows = [{"text": words(rng, SEQ)} for _ in range(8)]
    rows += [{"messages": [{"role": "user", "content": words(rng, 4)}], "id": f"q{i}"} for i in range(5)]
    mixed = write_jsonl(tmp_path / "mixed.jsonl", rows)
    out = tmp_path / "budget"
    said = []
    info = train(options(target, mixed, out, steps=None, time_budget=3.0, warmup_steps=loop.PLAN_AFTER,
                         regenerate=True, max_response_tokens=6, regenerate_batch=2), log=said.append)
    regenerated = [json.loads(line) for line in (out / "regenerated.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in regenerated) == [f"jsonl:q{i}" for i in range(5)]
    assert all(1 <= len(r["ids"]) <= 6 for r in regenerated)
    assert any(m.startswith("responses: 5 items, 5 generated now") for m in said), said
    planned = [m for m in said if m.startswith("time budget")]
    assert len(planned) == 1 and info["steps"] == int(planned[0].split(": ")[1].split()[0]) >= loop.PLAN_AFTER
    assert info["reproduce"][-4:] == ["--steps", str(info["steps"]), "--warmup-steps", str(loop.PLAN_AFTER)]
    assert "--time-budget" not in info["reproduce"]
    assert len(log_of(out)) == info["steps"]
    # --regenerate-only writes the responses and stops; another run takes them: none generated
    # again, the same training
    only = train(options(target, mixed, tmp_path / "only", regenerate=True, max_response_tokens=6,
                         regenerate_batch=2, regenerate_only=True), log=lambda m: None)
    assert only["generated"] == 5 and not (tmp_path / "only" / "model.safetensors").exists()
    assert sorted((tmp_path / "only" / "regenerated.jsonl").read_text().splitlines()) == sorted(
        (out / "regenerated.jsonl").read_text().splitlines())
    again, said2 = tmp_path / "again", []
    info2 = train(options(target, mixed, again, steps=info["steps"], warmup_steps=loop.PLAN_AFTER, regenerate=True,
                          max_response_tokens=6, responses=str(tmp_path / "only" / "regenerated.jsonl")),
                  log=said2.append)
    assert any(m.startswith("responses: 5 items, 0 generated now") for m in said2), said2
    assert sorted((again / "regenerated.jsonl").read_text().splitlines()) == sorted(
        (out / "regenerated.jsonl").read_text().splitlines())
    a, b = load_file(str(out / "model.safetensors")), load_file(str(again / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a) and info2["steps"] == info["steps"]
    (tmp_path / "bad.jsonl").write_text('{"id": "jsonl:q0", "ids": [5, 100000]}\n')
    with pytest.raises(ConfigError, match="outside the target's vocabulary"):
        train(options(target, mixed, tmp_path / "bad", regenerate=True, responses=str(tmp_path / "bad.jsonl")),
              log=said2.append)
    (tmp_path / "bad.jsonl").write_text('{"id": 3}\n')
    with pytest.raises(ConfigError, match="bad.jsonl:1: not a response line"):
        train(options(target, mixed, tmp_path / "bad2", regenerate=True, responses=str(tmp_path / "bad.jsonl")),
              log=said2.append)
    with pytest.raises(ConfigError, match="--regenerate-only needs --regenerate"):
        options(target, mixed, tmp_path / "bad4", regenerate_only=True).check()
    with pytest.raises(ConfigError, match="only with --regenerate"):
        options(target, mixed, tmp_path / "bad3", responses=str(tmp_path / "bad.jsonl")).check()


def test_bf16_target_and_precision_train_and_snapshot(target, corpus, tmp_path):
    out = tmp_path / "bf16"
    train(options(target, corpus, out, target_dtype="bfloat16", precision="bf16", snapshot_every=2))
    log = log_of(out)
    assert [r["step"] for r in log] == [1, 2, 3, 4] and all(r["loss"] == r["loss"] for r in log)  # no NaN
    snaps = sorted(p.name for p in (out / "snapshots").iterdir())
    assert snaps == ["step-000002", "step-000004"]
    head = load_eagle3(out / "snapshots" / "step-000002", load_decoder(target, "cpu"))
    assert head.w.fc.dtype == torch.float32  # weights stay fp32 under bf16 autocast
    assert json.loads((out / "snapshots" / "step-000004" / "snapshot.json").read_text())["step"] == 4


@pytest.mark.parametrize("argv, message", [
    (["--target-dtype", "int8"], "--target-dtype must be one of float32, bfloat16"),
    (["--snapshot-every", "0"], "--snapshot-every must be a positive integer"),
    (["--steps", "2", "--tokens", "5"], "give one of --steps, --tokens and --time-budget"),
    (["--time-budget", "-3"], "--time-budget must be a positive number"),
    (["--time-budget", "30", "--warmup-steps", "3"], "give --warmup-steps >= 12"),
    (["--steps", "0"], "--steps must be a positive integer"),
    (["--seq-len", "4"], "--seq-len must be at least"),
    (["--draft-vocab", "500"], "--draft-vocab must be between 1 and the target's vocabulary size 96"),
    (["--data", "prose"], "unknown --data source 'prose'"),
    (["--data", "jsonl:/nonexistent.jsonl"], "no such file"),
    (["--resume"], "holds no checkpoint"),
    (["--lr", "-1"], "--lr must be a positive number"),
    (["--batch-size", "0"], "--batch-size must be a positive integer"),
])
def test_bad_arguments_are_one_line_errors(target, corpus, tmp_path, capsys, argv, message):
    out = tmp_path / "out"
    args = ["train", "eagle3", "--target", str(target), "--data", f"jsonl:{corpus}", "--out", str(out), *argv]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err, err
    assert not (out / "train_log.jsonl").exists()


def test_nonempty_out_refused(target, corpus, tmp_path, capsys):
    (tmp_path / "junk").write_text("x")
    assert main(["train", "eagle3", "--target", str(target), "--data", f"jsonl:{corpus}",
                 "--out", str(tmp_path)]) == 2
    assert "not empty" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_two_processes_match_one(target, corpus, tmp_path):
    """Global batch 4 split 2 + 2 over two gloo processes == one process on the batch of 4.
    The texts have different lengths, so the two halves have different numbers of valid rows in
    each unrolled step: the ranks must weight by the global counts, not by their own."""
    rng = random.Random(3)
    texts = write_jsonl(tmp_path / "texts.jsonl", [{"text": words(rng, rng.choice((6, 11, 17, SEQ)))}
                                                   for _ in range(16)])
    args = ["train", "eagle3", "--target", str(target), "--data", f"jsonl:{texts}", "--steps", "3",
            "--seq-len", str(SEQ), "--batch-size", "4", "--ttt-steps", "3", "--draft-vocab", "96",
            "--no-progress", "--threads", "1"]
    one = tmp_path / "one"
    assert main(args + ["--out", str(one)]) == 0
    two = tmp_path / "two"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).parents[1]))
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                          "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
                          "-m", "outrider.cli", *args, "--out", str(two)],
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    a, b = load_file(str(one / "model.safetensors")), load_file(str(two / "model.safetensors"))
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5, msg=k)
    la, lb = log_of(one), log_of(two)
    assert [r["tokens"] for r in la] == [r["tokens"] for r in lb]
    assert [r["loss"] for r in lb] == pytest.approx([r["loss"] for r in la], rel=1e-4)
    shutil.rmtree(two)


def test_init_from_a_head_continues_it(target, corpus, tmp_path):
    """--init-from: the new run starts from the exported head's function (its first loss is the
    loss the first run ended near, far below a fresh head's) and its draft vocabulary."""
    first = tmp_path / "first"
    train(options(target, corpus, first, steps=12, lr=3e-3), log=lambda m: None)
    fresh = tmp_path / "fresh"
    train(options(target, corpus, fresh, steps=1), log=lambda m: None)
    said = []
    cont = tmp_path / "cont"
    train(options(target, corpus, cont, steps=1, lr=1e-9, init_from=str(first)), log=said.append)
    assert any(m.startswith(f"starting from the head {first}") for m in said)
    a, b = load_file(str(first / "model.safetensors")), load_file(str(cont / "model.safetensors"))
    assert torch.equal(a["d2t"], b["d2t"])
    assert torch.allclose(a["fc.weight"], b["fc.weight"], rtol=1e-3, atol=1e-6)  # the same function at lr ~0
    assert log_of(cont)[0]["loss"] < log_of(fresh)[0]["loss"] - 0.2
    from outrider.errors import ModelError

    with pytest.raises(ModelError, match="config.json not found"):
        train(options(target, corpus, tmp_path / "bad", steps=1, init_from=str(tmp_path / "nothing")))


def test_vocabulary_coverage_counts_each_item_once(target, tmp_path):
    """Two short texts (12 labels) against a plan of 48 labels: the draft vocabulary is counted over
    the 12 labels of the 2 items, not over the items cycled until 48."""
    rng = random.Random(7)
    few = write_jsonl(tmp_path / "few.jsonl", [{"text": words(rng, 6)} for _ in range(2)])
    said = []
    train(options(target, few, tmp_path / "out", steps=1), log=said.append)
    line = next(m for m in said if m.startswith("draft vocabulary"))
    assert "of the 12 labels of all 2 items (each counted once)" in line, line


def test_resume_refuses_another_schedule(target, corpus, tmp_path, capsys):
    """A run of 4 steps resumed with --steps 8 (or another --lr or --warmup-steps) would jump in
    its learning-rate schedule: refused in one line that names the recorded value."""
    out = tmp_path / "run"

    class Stop(Exception):
        pass

    def stop_at_3(record):
        if record["step"] == 3:
            raise Stop

    with pytest.raises(Stop):
        train(options(target, corpus, out), log=lambda m: None, on_step=stop_at_3)
    args = ["train", "eagle3", "--target", str(target), "--data", f"jsonl:{corpus}", "--out", str(out), "--seq-len",
            "24", "--batch-size", "2", "--ttt-steps", "3", "--draft-vocab", "48", "--checkpoint-every", "2",
            "--no-progress", "--threads", "1", "--resume"]
    for extra, fix in ((["--steps", "8"], "resume it with --steps 4"), (["--steps", "4", "--lr", "0.01"],
                       "resume it with --lr 0.001"), (["--steps", "4", "--warmup-steps", "1"],
                       "resume it without --warmup-steps")):
        assert main(args + extra) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: --resume: ") and "\n" not in err and "learning-rate schedule" in err, err
        assert fix in err, err
    assert json.loads((out / "checkpoint" / "state.json").read_text())["step"] == 2  # nothing ran
    assert main(args + ["--steps", "4"]) == 0  # the recorded schedule: continues
    assert log_of(out)[-1]["step"] == 4
