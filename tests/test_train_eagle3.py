"""`outrider train eagle3` (issue 9, item 3) on a tiny random target and word-level tokenizer:
training lowers the loss on a fixed batch; a resumed run ends with the same tensors as an
uninterrupted one; the exported head loads (heads/eagle3_format.py) and drafts with greedy
speculative == autoregressive; the vocabulary maps invert; data sources tokenize with the right
loss masks, skip test suites and code-edit modules, and keep a seeded order a position can resume;
bad arguments are one-line errors before any loading; two torchrun processes (gloo) match one."""

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
from tiny import add_tokenizer, make_tiny

from outrider.cli import main
from outrider.errors import ConfigError
from outrider.heads.eagle3_format import draft_to_target, load_eagle3
from outrider.models.loader import load_decoder
from outrider.train import data, sources
from outrider.train.loop import TrainOptions, train
from outrider.train.vocab import count_labels, draft_vocab, vocab_maps

SEQ = 24  # words per text item = tokens (word-level tokenizer)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    folder = make_tiny("llama", tmp_path_factory.mktemp("train") / "t", vocab=96, layers=4)
    return add_tokenizer(folder)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(3, 40)}" for _ in range(n))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """16 raw texts of exactly SEQ tokens, plus chat items with and without responses."""
    rng = random.Random(0)
    rows = [{"text": words(rng, SEQ)} for _ in range(16)]
    rows += [{"messages": [{"role": "user", "content": words(rng, 5)},
                           {"role": "assistant", "content": words(rng, 6)}]} for _ in range(2)]
    rows += [{"messages": [{"role": "user", "content": words(rng, 5)}]}]  # no response: skipped
    return write_jsonl(tmp_path_factory.mktemp("data") / "train.jsonl", rows)


def options(target, corpus, out, **kw) -> TrainOptions:
    base = dict(target=str(target), data=f"jsonl:{corpus}", out=str(out), steps=4, seq_len=SEQ, batch_size=2,
                ttt_steps=3, draft_vocab=48, checkpoint_every=2, progress=False, threads=1)
    base.update(kw)
    return TrainOptions(**base)


def log_of(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


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
    from outrider.engine import LLM

    out = tmp_path / "head"
    train(options(target, corpus, out, steps=2), log=lambda m: None)
    head = load_eagle3(out, load_decoder(target, "cpu"))
    assert head.config.draft_vocab_size == 48 and head.w.draft_to_target.shape == (48,)
    prompts = [words(random.Random(i), 6) for i in range(3)]
    plain = LLM(str(target)).generate(prompts, 12)
    spec = LLM(str(target), drafter=f"eagle3:{out}", controller="fixed:3").generate(prompts, 12)
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    assert sum(c.stats["drafted"] for c in spec) > 0  # the head really drafted


def test_vocab_maps_invert():
    counts = torch.tensor([0, 2, 0, 0, 3, 1])  # the docstring's example
    used = draft_vocab(counts, 3)
    assert used.tolist() == [1, 4, 5]
    assert draft_vocab(torch.tensor([1, 1, 1, 1]), 2).tolist() == [0, 1]  # ties: smaller ids
    d2t, t2d = vocab_maps(used, 6)
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert d2t.tolist() == [1, 3, 3] and t2d.tolist() == [False, True, False, False, True, True]
    assert torch.equal(draft_to_target(d2t, t2d), used)
    ex = [data.Example([4, 4, 1, 4, 1, 5], [True] * 6), data.Example([2, 2], [False, False])]
    assert count_labels(ex, 6).tolist() == [0, 2, 0, 0, 3, 1]
    with pytest.raises(ConfigError, match="--draft-vocab"):
        draft_vocab(counts, 7)
    with pytest.raises(ConfigError, match="--draft-vocab"):
        draft_vocab(counts, 0)


def test_examples_masks_and_order(target, corpus):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target))
    c = data.load_corpus(f"jsonl:{corpus}", regenerate=False)
    assert c.skipped == 1 and len(c.items) == 18
    enc = data.Encoder(tok, 10)
    text = next(i for i in c.items if i.kind == "text")
    chunks = enc.examples(text)
    assert [len(e.tokens) for e in chunks] == [10, 10, 4] and all(all(e.mask) for e in chunks)
    chat = next(i for i in c.items if i.kind == "chat")
    (ex,) = data.Encoder(tok, 64).examples(chat)
    prompt = enc.prompt_ids(chat)
    assert ex.mask == [False] * len(prompt) + [True] * (len(ex.tokens) - len(prompt))
    assert tok.decode(ex.tokens[len(prompt):]).split()[:6] == chat.response.split()  # then <|im_end|>
    assert ex.tokens[len(prompt) + 6] == tok.convert_tokens_to_ids("<|im_end|>")  # the template's end of turn
    # order: a pure function of the seed; a position resumes the same stream
    def take(stream, n, start=data.Position()):
        return [(after, e.tokens) for (after, e), _ in zip(stream.examples(start), range(n))]

    first = take(data.Stream(c, enc, seed=3), 60)  # into epoch 2 (16 texts x 3 chunks + 2 chats = 50)
    assert take(data.Stream(c, enc, seed=3), 60) == first
    assert take(data.Stream(c, enc, seed=3), 48, start=first[11][0]) == first[12:60]
    assert [t for _, t in first[:50]] != [t for _, t in first[50:]][:50]  # epoch 2 has its own order
    assert [t for _, t in take(data.Stream(c, enc, seed=4), 60)] != [t for _, t in first]


def test_length_groups_batch_similar_lengths_and_resume_anywhere(target, tmp_path):
    rng = random.Random(1)
    rows = [{"text": words(rng, rng.randrange(2, SEQ + 1))} for _ in range(40)]
    c = data.load_corpus(f"jsonl:{write_jsonl(tmp_path / 'v.jsonl', rows)}", regenerate=False)
    from outrider.engine import _load_tokenizer

    enc = data.Encoder(_load_tokenizer(target), SEQ)

    def take(n, group, start=data.Position()):
        return list(zip(range(n), data.batches(data.Stream(c, enc, seed=5), 4, start, group=group)))

    plain, grouped = take(20, 1), take(20, 5)  # 80 examples: two epochs, four groups of 5 batches
    tokens = lambda got: [[tuple(e.tokens) for e in b] for _, (_, b) in got]  # noqa: E731
    for w in range(4):  # each group of 5 batches holds the same examples as 5 plain batches...
        a, b = tokens(plain)[5 * w:5 * w + 5], tokens(grouped)[5 * w:5 * w + 5]
        assert sorted(x for batch in a for x in batch) == sorted(x for batch in b for x in batch)
        spans = sorted((min(map(len, batch)), max(map(len, batch))) for batch in b)
        assert all(hi <= lo for (_, hi), (lo, _) in zip(spans, spans[1:]))  # ...cut by length
    padded = lambda got: sum(len(b) * max(map(len, b)) for b in tokens(got))  # noqa: E731
    assert padded(grouped) < 0.85 * padded(plain)
    assert [p for _, (p, _) in grouped][4::5] == [p for _, (p, _) in plain][4::5]  # same stream position
    for k in (0, 2, 4, 7):  # a position resumes the same batches, inside a group or at its end
        assert tokens(take(20 - k - 1, 5, start=grouped[k][1][0])) == tokens(grouped)[k + 1:]


def test_code_roots_read_other_folders(tmp_path):
    for name in ("proj/app/__init__.py", "proj/app/core.py", "lib/util.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text('def add(a, b):\n    """Add two numbers."""\n    return a + b\n')
    one = data.load_corpus("code-completions", regenerate=False, roots=[tmp_path / "proj" / "app"]).items
    assert [i.id for i in one] == ["code-completions:app:add", "code-completions:app.core:add"]
    two = data.load_corpus("code,code-prompts", regenerate=True, roots=[tmp_path / "proj", tmp_path / "lib"])
    assert sorted(i.id for i in two.items if i.kind == "text") == [
        "code:lib/util.py", "code:proj/app/__init__.py", "code:proj/app/core.py"]
    assert "code-prompts:lib/util:add" in {i.id for i in two.items}
    assert any("lib" in line for line in two.sources)
    with pytest.raises(ConfigError, match="--code-root .*no such folder"):
        options(tmp_path, tmp_path / "x.jsonl", tmp_path / "o", data="code", code_roots=[str(tmp_path / "nope")]).check()


def test_code_source_leaves_out_tests_and_code_edit_modules(tmp_path):
    for name in ("argparse.py", "foo.py", "test/bar.py", "json/decoder.py", "json/__init__.py",
                 "pkg/tests/baz.py", "test_x.py", "site-packages/q.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("def f(a, b=1):\n    '''Add one.'''\n    return a\n")
    files = sorted(str(p.relative_to(tmp_path)) for p in sources.stdlib_files(tmp_path))
    assert files == ["foo.py", "json/__init__.py"]
    c = data.load_corpus("code-prompts", regenerate=True, stdlib=tmp_path)
    assert [i.id for i in c.items] == ["code-prompts:foo:f", "code-prompts:json:f"]
    assert "`f(a, b=1)`" in c.items[0].messages[0]["content"]
    with pytest.raises(ConfigError, match="--regenerate"):
        data.load_corpus("code-prompts", regenerate=False, stdlib=tmp_path)


FOO_PY = '''import os


def add(a, b=1):
    """Add b to a.

    More.
    """
    c = a + b
    return c


def _hidden(x):
    'Private.'
    return x


def bare(x):
    return x


class Box:
    'A box.'

    def size(self):
        """How big."""
        return 3

    @property
    def name(self):
        'The name.'
        return 'b'

    @name.setter
    def name(self, v):
        'Set it.'
        self.n = v

    def only_doc(self):
        'Nothing after.'
'''


def test_code_completions_are_humaneval_shaped(tmp_path):
    (tmp_path / "foo.py").write_text(FOO_PY)
    c = data.load_corpus("code-completions", regenerate=False, stdlib=tmp_path)
    items = {i.id: i for i in c.items}
    assert list(items) == ["code-completions:foo:add", "code-completions:foo:Box.size",
                           "code-completions:foo:Box.name"]
    add = items["code-completions:foo:add"]
    assert add.kind == "prompt" and add.text == 'def add(a, b=1):\n    """Add b to a.\n\n    More.\n    """\n'
    assert add.response == "    c = a + b\n    return c\n"
    size = items["code-completions:foo:Box.size"]  # a method, dedented; decorators left out
    assert size.text == 'def size(self):\n    """How big."""\n' and size.response == "    return 3\n"
    assert items["code-completions:foo:Box.name"].response == "    return 'b'\n"  # the getter, defined first


def test_greedy_batch_commits_what_generate_ids_commits(target):
    from outrider.generation import Request, generate_ids
    from outrider.sampling import SamplingParams
    from outrider.train.regenerate import greedy_batch

    decoder = load_decoder(target, "cpu")
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 96) for _ in range(n)] for n in (1, 5, 9, 3)]
    limits = [6, 11, 2, 9]
    no_eos = greedy_batch(decoder, prompts, limits, set())
    assert [len(g) for g in no_eos] == limits  # without end tokens every response runs to its limit
    eos = {no_eos[0][2], no_eos[3][4]}  # tokens the greedy runs do produce: some responses end early
    want = [f.output_ids for f in generate_ids(decoder, [Request(p, m, SamplingParams(0.0))
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


def test_a_source_count_keeps_a_fixed_subset(tmp_path):
    for i in range(6):
        (tmp_path / f"m{i}.py").write_text(f"def f{i}(a):\n    return a\n")
    every = data.load_corpus("code", regenerate=False, stdlib=tmp_path).items
    two = data.load_corpus("code:2", regenerate=False, stdlib=tmp_path).items
    assert len(every) == 6 and len(two) == 2 and set(i.id for i in two) < set(i.id for i in every)
    assert two == data.load_corpus("code:2", regenerate=False, stdlib=tmp_path).items
    with pytest.raises(ConfigError, match="positive integer"):
        data.parse_sources("code:0")
    with pytest.raises(ConfigError, match="twice"):
        data.parse_sources("code,code:3")


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
