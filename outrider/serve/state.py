"""What the handlers hold: the server's state (`ServerState`) and each request's plan (`Plan`).

`ServerState` is what every route reads: the LLM (tokenizer, chat template, target), the engine
worker, the metrics, the served model's name and API key, and the tokenizer's lock (the HTTP side
encodes while the engine thread decodes). A `Plan` is one checked request as the engine will run
it (api.py makes it): its prompts' token ids, what echo shows, and its `Job` of one Request a choice.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from .metrics import Metrics
from .errors import ApiError
from .protocol import Parsed
from . import tools
from .worker import EngineWorker, Job


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

    def __post_init__(self):
        if self.structured is None:
            self.structured = tools.Structured(self.llm, self.tokenizer_lock)

    @property
    def vocab(self) -> int:
        return self.llm.target.config.vocab_size

    def encode(self, parsed: Parsed) -> list[list[int]]:
        """Token ids of each prompt (chat: the one templated conversation)."""
        tok = self.llm.tokenizer
        with self.tokenizer_lock:
            if parsed.messages is None:
                return [list(p) if isinstance(p, list) else tok(p)["input_ids"] for p in parsed.prompts]
            if not getattr(tok, "chat_template", None):
                raise ApiError(400, f"model '{self.model_name}' has no chat template: use /v1/completions")
            try:
                native = (parsed.tools or any(m["role"] == "tool" or "tool_calls" in m for m in parsed.messages)) \
                    and self.structured.native_tools()
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
