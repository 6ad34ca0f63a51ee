"""Shared by the training tests: a tiny random target with a word-level tokenizer, a JSONL corpus
of raw texts and chat items, and TrainOptions for quick runs."""

import json
import random
from pathlib import Path

import pytest
from tiny import add_tokenizer, make_tiny

from outrider.train.loop import TrainOptions

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
