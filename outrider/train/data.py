"""Training text for learned drafters: named sources -> items -> token examples with a loss mask.

Sources (`--data a,b,...`; a `jsonl:PATH` goes last if its path holds a comma; their builders are
in train/sources.py):

    code          Python standard-library files (sysconfig stdlib of the running Python), raw text,
                  without test suites and without the modules the code-edit workload edits;
                  `--code-root DIR` (repeatable) reads DIR's .py files instead, for this source
                  and the next two: your own project, or installed packages
    code-prompts  chat prompts "Write a Python function `name(args)` ..." from the docstrings of
                  public stdlib functions, again not from the code-edit modules (need --regenerate)
    code-completions  completion prompts in HumanEval's form: a public stdlib function or method's
                  `def` line and docstring, dedented (the body is the item's own response; with
                  --regenerate the target writes it); not from the code-edit modules
    toolcall      BFCL v4 categories the toolcall workload does not use (live_multiple, parallel,
                  parallel_multiple), as chat messages like workloads.toolcall_messages (need --regenerate)
    humaneval     HumanEval prompts + canonical solutions (completion mode). It IS the bench
                  workload: a head trained on it is contaminated for that benchmark
    NAME:N        N items of a source (a fixed subset: the first N by sha256 of their ids)
    jsonl:PATH    one object a line: {"text": str} (raw), {"prompt": str, "response"?: str}
                  (completion mode, as the bench's jsonl) or {"messages": [...]} (chat; a last
                  assistant message is the response); optional "id"

An item becomes examples (data.Example): raw text is tokenized and cut into `seq_len` chunks,
the loss on every token; a prompt or chat item is its prompt tokens (chat template applied) then
its response tokens, the loss on the response only, cut to `seq_len`. Responses come from the
item, or with `--regenerate` from the target itself (train/regenerate.py); items with neither are
skipped and counted. Order: epoch e visits the items sorted by sha256(f"{seed}:{e}:{id}"), so the
order, and a `Position` in it, are pure functions of the seed (a resumed run sees the same batches).
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from ..errors import ConfigError
from .items import Item
from .sources import build, jsonl_items

SOURCES = ("code", "code-prompts", "code-completions", "toolcall", "humaneval", "jsonl:PATH")


@dataclass
class Example:
    tokens: list[int]  # [n]
    mask: list[bool]  # [n]: True where token i is a training label


@dataclass(frozen=True)
class Position:
    """Where the stream is: the next example is chunk `chunk` of item `item` of epoch `epoch`.
    With length groups (`batches(..., group=G)`), the position of a group's first example and
    `skip`, how many of the group's batches were taken already."""
    epoch: int = 0
    item: int = 0
    chunk: int = 0
    skip: int = 0

    def to_json(self) -> list[int]:
        return [self.epoch, self.item, self.chunk, self.skip]


@dataclass
class Corpus:
    items: list[Item]  # usable items (those without a needed response already dropped)
    skipped: int  # chat / prompt items without a response and no --regenerate
    sources: list[str] = field(default_factory=list)  # where each source came from (sha256 or path)


def parse_sources(spec: str) -> list[str]:
    """'code,toolcall,jsonl:a.jsonl' -> names; a one-line ConfigError for an unknown one."""
    if not spec or not spec.strip():
        raise ConfigError(f"--data is empty: give one or more of {', '.join(SOURCES)}, comma-separated")
    names, rest = [], spec.strip()
    while rest:
        if rest.startswith("jsonl:"):
            names.append(rest)
            break
        name, _, rest = rest.partition(",")
        names.append(name.strip())
    for name in names:
        if name.startswith("jsonl:"):
            if not Path(name[len("jsonl:"):]).expanduser().is_file():
                raise ConfigError(f"--data {name}: no such file")
            continue
        base, _, count = name.partition(":")
        if base not in SOURCES:
            raise ConfigError(f"unknown --data source '{base}': use {', '.join(SOURCES)} (comma-separated; "
                              "NAME:N keeps N of its items)")
        if count and (not count.isdigit() or int(count) < 1):
            raise ConfigError(f"--data {name}: the count after ':' must be a positive integer")
    if len({n.partition(":")[0] if not n.startswith("jsonl:") else n for n in names}) != len(names):
        raise ConfigError(f"--data names a source twice: {spec}")
    return names


def load_corpus(spec: str, *, regenerate: bool, fixtures: Path | None = None, stdlib: Path | None = None,
                roots: list | None = None) -> Corpus:
    """Every item of the sources in `spec`; refuses (one line) a corpus with nothing to train on.
    The code sources read `roots` (--code-root folders), else `stdlib` (default: this Python's)."""
    roots = [Path(r).expanduser() for r in roots] if roots else [Path(stdlib or sysconfig.get_paths()["stdlib"])]
    items, sources = [], []
    for name in parse_sources(spec):
        if name.startswith("jsonl:"):
            got, where = jsonl_items(Path(name[6:]).expanduser())
        else:
            base, _, count = name.partition(":")
            got, where = build(base, roots, fixtures)
            if count:  # a fixed subset, the same for every seed: first N by sha256 of the id
                got = sorted(got, key=lambda i: hashlib.sha256(f"subset:{i.id}".encode()).hexdigest())[:int(count)]
        items += got
        sources.append(f"{name}: {len(got)} items from {where}")
    keep = [i for i in items if regenerate or i.kind == "text" or i.response is not None]
    if not keep:
        raise ConfigError(f"--data {spec}: no item has a response to train on; add --regenerate so the "
                          "target writes them, or add a raw-text source such as code")
    ids = [i.id for i in keep]
    if len(set(ids)) != len(ids):
        raise ConfigError(f"--data {spec}: two items share an id; give the jsonl lines distinct ids")
    return Corpus(keep, len(items) - len(keep), sources)


def epoch_order(items: list[Item], seed: int, epoch: int) -> list[Item]:
    return sorted(items, key=lambda i: hashlib.sha256(f"{seed}:{epoch}:{i.id}".encode()).hexdigest())


# ---- items -> examples ------------------------------------------------------------------------

class Encoder:
    """Tokenizes items the way the engine does (engine.LLM.encode): the tokenizer's own chat
    template for chat items, add_special_tokens for completion prompts, none for raw text."""

    def __init__(self, tokenizer, seq_len: int):
        self.tokenizer, self.seq_len = tokenizer, seq_len

    def prompt_ids(self, item: Item) -> list[int]:
        tok = self.tokenizer
        if item.kind == "prompt":
            return tok(item.text)["input_ids"]
        if not getattr(tok, "chat_template", None):
            raise ConfigError("the target's tokenizer has no chat template: use raw-text sources (code, jsonl text)")
        text = tok.apply_chat_template(list(item.messages), add_generation_prompt=True, tokenize=False)
        return tok(text, add_special_tokens=False)["input_ids"]

    def response_ids(self, item: Item) -> list[int]:
        """The item's own response as tokens (the chat template's end-of-turn included)."""
        tok = self.tokenizer
        if item.kind == "prompt":
            return tok(item.response, add_special_tokens=False)["input_ids"]
        messages = list(item.messages)
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        full = tok.apply_chat_template(messages + [{"role": "assistant", "content": item.response}], tokenize=False)
        tail = full[len(prompt):] if full.startswith(prompt) else item.response
        return tok(tail, add_special_tokens=False)["input_ids"]

    def examples(self, item: Item, response: list[int] | None = None) -> list[Example]:
        """The item's examples; `response` (token ids) replaces the item's own response."""
        n = self.seq_len
        if item.kind == "text":
            ids = self.tokenizer(item.raw_text(), add_special_tokens=False)["input_ids"]
            return [Example(ids[i:i + n], [True] * len(ids[i:i + n])) for i in range(0, len(ids), n)
                    if len(ids[i:i + n]) >= 2]
        prompt = self.prompt_ids(item)
        answer = response if response is not None else self.response_ids(item)
        tokens = (prompt + answer)[:n]
        if len(prompt) >= len(tokens) or not answer:
            return []  # the prompt fills the whole window: nothing to learn from
        return [Example(tokens, [False] * len(prompt) + [True] * (len(tokens) - len(prompt)))]


ENCODED_CAP = 64_000_000  # tokens of tokenized items a Stream keeps (a few GB at most)
Responder = Callable[[list[Item]], list[list[int]]]  # items -> response token ids (the target's)


class Stream:
    """Examples in the seeded order from `start`, epoch after epoch (never ends)."""

    def __init__(self, corpus: Corpus, encoder: Encoder, seed: int, responder: Responder | None = None,
                 lookahead: int = 16):
        self.corpus, self.encoder, self.seed = corpus, encoder, seed
        self.responder, self.lookahead = responder, lookahead
        self.responses: dict[str, list[int]] = {}
        self._encoded: dict[str, list[Example]] = {}  # each item tokenized once (epochs revisit it)
        self._encoded_tokens = 0

    def examples(self, start: Position = Position()) -> Iterator[tuple[Position, Example]]:
        """(position of the example after this one, example), from `start` on."""
        epoch, first, chunk = start.epoch, start.item, start.chunk
        while True:
            order = epoch_order(self.corpus.items, self.seed, epoch)
            for index in range(first, len(order)):
                item = order[index]
                response = self._response(order, index) if self.responder and item.kind != "text" else None
                chunks = self._examples(item, response)
                for c in range(chunk, len(chunks)):
                    last = c + 1 == len(chunks)
                    after = Position(epoch, index + 1, 0) if last else Position(epoch, index, c + 1)
                    yield after, chunks[c]
                chunk = 0
            epoch, first = epoch + 1, 0

    def _examples(self, item: Item, response: list[int] | None) -> list[Example]:
        """encoder.examples(item, response), kept for later epochs while under ENCODED_CAP tokens."""
        chunks = self._encoded.get(item.id)
        if chunks is None:
            chunks = self.encoder.examples(item, response)
            size = sum(len(c.tokens) for c in chunks)
            if self._encoded_tokens + size <= ENCODED_CAP:
                self._encoded[item.id] = chunks
                self._encoded_tokens += size
        return chunks

    def respond_all(self) -> int:
        """Responses for every item that needs one, generated now (the responder batches them);
        returns how many items needed one. Training steps then all cost the same."""
        todo = [i for i in epoch_order(self.corpus.items, self.seed, 0) if i.kind != "text"
                and i.id not in self.responses]
        if todo and self.responder is not None:
            for item, ids in zip(todo, self.responder(todo)):
                self.responses[item.id] = ids
        return len(todo)

    def _response(self, order: list[Item], index: int) -> list[int]:
        """The target's response to order[index], generated with the next few items that need one."""
        item = order[index]
        if item.id not in self.responses:
            todo = [i for i in order[index:] if i.kind != "text" and i.id not in self.responses][: self.lookahead]
            for done, ids in zip(todo, self.responder(todo)):
                self.responses[done.id] = ids
        return self.responses[item.id]


def batches(stream: Stream, batch_size: int, start: Position = Position(),
            group: int = 1) -> Iterator[tuple[Position, list[Example]]]:
    """Global batches of `batch_size` examples: (position after the batch, examples).

    group > 1: the next `group` batches' examples are sorted by length (longest first, ties in
    stream order) and cut into `group` batches of similar lengths, taken in a seeded order, so a
    batch pads to its own longest example rather than to a random one's (about half the padded
    tokens on a mix of short responses and full code chunks). A pure function of the stream."""
    if group == 1:
        batch, it = [], stream.examples(Position(start.epoch, start.item, start.chunk))
        for after, example in it:
            batch.append(example)
            if len(batch) == batch_size:
                yield after, batch
                batch = []
        return
    first, skip = Position(start.epoch, start.item, start.chunk), start.skip
    it = stream.examples(first)
    while True:
        window = [next(it) for _ in range(group * batch_size)]
        after = window[-1][0]
        examples = [e for _, e in window]
        by_length = sorted(range(len(examples)), key=lambda i: (-len(examples[i].tokens), i))
        cut = [[examples[i] for i in by_length[b * batch_size:(b + 1) * batch_size]] for b in range(group)]
        key = f"{stream.seed}:{first.epoch}:{first.item}:{first.chunk}"
        order = sorted(range(group), key=lambda b: hashlib.sha256(f"{key}:{b}".encode()).hexdigest())
        for taken in range(skip, group):
            done = taken + 1 == group
            yield (after if done else Position(first.epoch, first.item, first.chunk, taken + 1)), cut[order[taken]]
        first, skip = after, 0
