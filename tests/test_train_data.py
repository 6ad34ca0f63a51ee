"""Training data for learned drafters (issue 9, item 3): data sources tokenize with the right loss
masks, skip test suites and code-edit modules, read other code folders, keep a seeded order a
position can resume, batch similar lengths together, keep fixed subsets; the vocabulary maps invert."""

import random

import pytest
import torch
from train_common import SEQ, corpus, options, target, words, write_jsonl  # noqa: F401 (fixtures)

from outrider.errors import ConfigError
from outrider.heads.vocab_map import draft_to_target
from outrider.train import data, sources
from outrider.train.vocab import count_labels, draft_vocab, vocab_maps


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
    from outrider.weights.tokenizer import load_tokenizer

    enc = data.Encoder(load_tokenizer(target), SEQ)

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
