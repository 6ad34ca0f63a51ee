"""The OpenAI wire format: request bodies checked field by field, responses and stream chunks.

A bad body never reaches the engine: `parse_completion` / `parse_chat` raise `ApiError` with
the HTTP status and the OpenAI error body (`{"error": {"message", "type", "param", "code"}}`).
Fields this server does not use are ignored when absent or at their neutral value; a field
of the wrong type, or a value it cannot honour (n > 1, logprobs), is refused with a 400.
Outrider's own fields: `speculate` (bool), `max_draft_tokens` (int >= 0) and `ignore_eos`
(bool, as in vLLM) per request, and
the `outrider` object in every response (tau, rounds, drafts and acceptance of this request).
"""

from __future__ import annotations

import numbers
import time
import uuid
from dataclasses import dataclass, field

from ..errors import ConfigError
from ..sampling import SamplingParams


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Parsed:
    """One request, checked: the prompt (text or chat messages) and how to generate."""

    prompt: str | list[int] | None  # completions: text or token ids
    messages: list[dict] | None  # chat: [{"role", "content": str}]
    max_tokens: int
    params: SamplingParams
    stops: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    speculate: bool = True
    max_draft_tokens: int | None = None
    model: str | None = None
    ignore_eos: bool = False


DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions; chat defaults to what the context holds


def parse_completion(body) -> Parsed:
    body = _object(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
            raise ApiError(400, "prompt must be a string, a list of one string, or a non-empty list of "
                                "token ids (one prompt per request)", "prompt")
    elif not isinstance(prompt, str):
        raise ApiError(400, "prompt is required: a string", "prompt")
    if body.get("echo") not in (None, False):
        raise ApiError(400, "echo is not supported: leave it out", "echo")
    return _common(body, DEFAULT_MAX_TOKENS, prompt=prompt, messages=None)


def parse_chat(body) -> Parsed:
    body = _object(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages is required: a non-empty list of {role, content}", "messages")
    checked = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a string role", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ApiError(400, f"messages[{i}].content parts must be {{type: text, text: string}}", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string", "messages")
        checked.append({"role": m["role"], "content": content})
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    return _common(body, None, prompt=None, messages=checked, max_key=key)


def _object(body) -> dict:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def _common(body: dict, default_max, *, prompt, messages, max_key: str = "max_tokens") -> Parsed:
    max_tokens = _int(body, max_key, default_max, minimum=1)
    temperature = _number(body, "temperature", 1.0)
    top_p = _number(body, "top_p", 1.0)
    top_k = _int(body, "top_k", 0, minimum=-1)
    seed = _int(body, "seed", None, minimum=0)
    n = _int(body, "n", 1, minimum=1)
    if n != 1:
        raise ApiError(400, "n must be 1: send one request per completion", "n")
    for name in ("logprobs", "top_logprobs"):
        if body.get(name) not in (None, False, 0):
            raise ApiError(400, f"{name} is not supported: leave it out", name)
    for name in ("presence_penalty", "frequency_penalty"):
        if _number(body, name, 0.0) != 0.0:
            raise ApiError(400, f"{name} is not supported (it would change the target's distribution): use 0", name)
    try:
        params = SamplingParams(temperature, max(top_k, 0), top_p, seed)
    except (ConfigError, TypeError) as err:
        raise ApiError(400, str(err)) from None
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ApiError(400, "stop must be a string or a list of strings", "stop")
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise ApiError(400, "stream_options must be an object", "stream_options")
    include_usage = _bool(options or {}, "include_usage", False, "stream_options.include_usage")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "model must be a string", "model")
    return Parsed(prompt, messages, max_tokens, params, [s for s in stops if s], stream, include_usage,
                  _bool(body, "speculate", True), _int(body, "max_draft_tokens", None, minimum=0), model,
                  _bool(body, "ignore_eos", False))


def _int(body: dict, key: str, default, minimum: int):
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ApiError(400, f"{key} must be an integer, got {value!r}", key)
    if value < minimum:
        raise ApiError(400, f"{key} must be >= {minimum}, got {value}", key)
    return int(value)


def _number(body: dict, key: str, default: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ApiError(400, f"{key} must be a number, got {value!r}", key)
    return float(value)


def _bool(body: dict, key: str, default: bool, name: str | None = None) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"{name or key} must be true or false, got {value!r}", name or key)
    return value


# -- responses -------------------------------------------------------------------------------------
OPENAI_REASON = {"eos": "stop", "stop": "stop", "length": "length", "context": "length", "cancelled": "abort"}


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def extension(completion) -> dict:
    """The `outrider` field: this request's own speculation figures (engine Completion)."""
    s, reason = completion.stats, completion.finish_reason
    return {"tau": s["mean_accepted_length"], "rounds": s["rounds"], "drafted": s["drafted"],
            "accepted": sum(s["accepted_by_position"]), "accepted_by_position": s["accepted_by_position"],
            "draft_rounds": (s["proposed_by_position"] or [0])[0],
            "acceptance_by_position": s["acceptance_by_position"], "finish_reason": reason}


def response(rid: str, model: str, chat: bool, text: str, reason: str, use: dict, ext: dict) -> dict:
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": OPENAI_REASON[reason]}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": OPENAI_REASON[reason]}
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": use, "outrider": ext}


def chunk(rid: str, model: str, chat: bool, text: str | None, reason: str | None = None, *,
          first: bool = False, use: dict | None = None, ext: dict | None = None) -> dict:
    """One server-sent event's payload; `text` None with `use` is the final usage chunk (no choices)."""
    out = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
           "created": int(time.time()), "model": model}
    if text is None and use is not None:
        out["choices"] = []
    else:
        finish = OPENAI_REASON[reason] if reason else None
        if chat:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            out["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
        else:
            out["choices"] = [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}]
    if use is not None:
        out["usage"] = use
    if ext is not None:
        out["outrider"] = ext
    return out
