"""What the handlers hold: the server's state (`ServerState`) and each request's plan (`Plan`).

`ServerState` is what every route reads: the LLM (tokenizer, chat template, target), the engine
worker, the metrics, the served model's name and API key, and the tokenizer's lock (the HTTP side
encodes while the engine thread decodes). A `Plan` is one checked request as the engine will run
it (api.py makes it): its prompts' token ids, what echo shows, and its `Job` of one Request a choice.

Prompts are tokenized in worker threads (api.py) with copies of the tokenizer (`Encoders`), never
under the lock the engine thread decodes under: a long prompt (seconds for megabytes) then delays
neither a running stream, nor /health, nor the other requests' tokenizing.
"""

from __future__ import annotations

import copy
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field

from .metrics import Metrics
from .errors import ApiError
from .fields import MAX_BODY_MB
from .protocol import Parsed
from . import tools
from .worker import EngineWorker, Job

ENCODERS = 4  # tokenizer copies the HTTP side encodes with at once


class Encoders:
    """Copies of a tokenizer, made as requests need them (at most `size`; more wait for one): each
    tokenizes one request at a time, so requests tokenize side by side and never under the lock
    that the original (the engine thread's decoding) is used under."""

    def __init__(self, tokenizer, lock: threading.Lock, size: int = ENCODERS):
        self.tokenizer, self.lock, self.size = tokenizer, lock, size
        self._free: list = []
        self._made = 0
        self._cond = threading.Condition()

    @contextmanager
    def borrow(self):
        with self._cond:
            self._cond.wait_for(lambda: self._free or self._made < self.size)
            tok = self._free.pop() if self._free else None
            self._made += tok is None
        if tok is None:
            try:
                with self.lock:
                    tok = copy.deepcopy(self.tokenizer)
            except BaseException:
                with self._cond:
                    self._made -= 1
                    self._cond.notify()
                raise
        try:
            yield tok
        finally:
            with self._cond:
                self._free.append(tok)
                self._cond.notify()


@dataclass
class ServerState:
    llm: object  # engine.LLM: tokenizer, chat template, target
    worker: EngineWorker
    metrics: Metrics
    model_name: str
    api_key: str | None = None
    # encode (HTTP) and decode (the engine's text streams) share the tokenizer
    tokenizer_lock: threading.Lock = field(default_factory=threading.Lock)
    _token_texts: dict[int, str] = field(default_factory=dict)
    structured: tools.Structured | None = None  # grammars of response_format and tool calls (tools.py)
    max_body_bytes: int = MAX_BODY_MB << 20  # a larger request body is refused with a 413 (api.py)
    encoders: Encoders | None = None

    def __post_init__(self):
        if self.structured is None:
            self.structured = tools.Structured(self.llm, self.tokenizer_lock)
        if self.encoders is None:
            self.encoders = Encoders(self.llm.tokenizer, self.tokenizer_lock)

    @property
    def vocab(self) -> int:
        return self.llm.target.config.vocab_size

    def encode(self, parsed: Parsed) -> list[list[int]]:
        """Token ids of each prompt (chat: the one templated conversation). Blocking: api.py calls
        it in a worker thread."""
        if parsed.messages is None and all(isinstance(p, list) for p in parsed.prompts):
            return [list(p) for p in parsed.prompts]
        native = False
        if parsed.messages is not None and (parsed.tools or any(m["role"] == "tool" or "tool_calls" in m
                                                                for m in parsed.messages)):
            with self.tokenizer_lock:
                native = self.structured.native_tools()
        with self.encoders.borrow() as tok:
            if parsed.messages is None:
                return [list(p) if isinstance(p, list) else tok(p)["input_ids"] for p in parsed.prompts]
            if not getattr(tok, "chat_template", None):
                raise ApiError(400, f"model '{self.model_name}' has no chat template: use /v1/completions")
            try:
                messages, extra = tools.template_input(parsed.messages, parsed.tools, native)
                text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **extra)
            except Exception as err:  # the template refuses this conversation (jinja raise_exception)
                raise ApiError(400, f"the model's chat template refused these messages: {err}", "messages") from None
            return [tok(text, add_special_tokens=False)["input_ids"]]

    def decode(self, ids: list[int]) -> str:
        with self.tokenizer_lock:
            return self.llm.decode(ids)

    def token_text(self, token: int) -> str:
        """One token's text, as logprobs show it (the tokenizer's decode of that id alone)."""
        text = self._token_texts.get(token)
        if text is None:
            with self.tokenizer_lock:
                text = self.llm.tokenizer.decode([token], skip_special_tokens=False,
                                                 clean_up_tokenization_spaces=False)
            self._token_texts[token] = text
        return text


@dataclass
class Plan:
    """A checked request as the engine will run it: one Request a choice."""

    parsed: Parsed
    prompt_ids: list[list[int]]
    prompt_texts: list[str]  # what echo shows
    job: Job

    def prompt_of(self, index: int) -> int:
        return index // self.parsed.n
