"""OpenAI request bodies, checked field by field before anything reaches the engine.

`parse_completion(body, vocab)` / `parse_chat(body, vocab)` return a `Parsed` or raise `ApiError`
(the HTTP status and the OpenAI error body `{"error": {"message", "type", "param", "code"}}`,
`param` naming the field). Every field of OpenAI's two routes is either honoured or refused
with a 400 that says what to send instead; none is ignored, and a field this server does not
know at all is refused too (docs/serving.md has the table, `FIELDS` in fields.py is its source).
Ranges are OpenAI's and vLLM's (temperature in [0, 2], penalties in [-2, 2], logit_bias values
in [-100, 100], at most 20 logprobs); token ids must lie in the model's vocabulary.

Outrider's own fields: `speculate` (bool), `max_draft_tokens` (int >= 0), `grammar_drafting`
(bool), and vLLM's `ignore_eos`, `top_k`, `min_p`, `repetition_penalty`, `stop_token_ids`.
`response_format`, `tools` and `tool_choice` are checked by tools.py.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from ..errors import ConfigError
from ..sampling import SamplingParams
from .errors import bad, show
from .fields import FIELDS, INT64, MAX_LOGPROBS, MAX_N, SEED_RANGE, WHY, Body

__all__ = ["Parsed", "parse_completion", "parse_chat", "FIELDS"]  # FIELDS: fields.py's, for the tests


@dataclass
class Parsed:
    """One request, checked: the prompt(s) (text, token ids or chat messages) and how to generate."""

    prompts: list[str | list[int]] | None  # completions: one entry per prompt
    messages: list[dict] | None  # chat: [{"role", "content": str, "name"?, "tool_calls"?, "tool_call_id"?}]
    max_tokens: int | None  # None: what the context holds (chat's default)
    params: SamplingParams
    n: int = 1
    stops: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None  # None: none; N: each output token's logprob and the top N
    echo: bool = False
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    speculate: bool = True
    max_draft_tokens: int | None = None
    model: str | None = None
    ignore_eos: bool = False
    max_key: str = "max_tokens"  # the field max_tokens came from (chat: max_completion_tokens too)
    response_format: dict | None = None  # json_object / json_schema (None: text)
    tools: list[dict] | None = None  # the function objects offered to the model (tool_choice not "none")
    tool_call: bool = False  # the output is one call of one of `tools` (tool_choice "required" or named)
    tool_name: str | None = None  # the function named by tool_choice
    grammar_drafting: bool = True

    @property
    def prompt_param(self) -> str:
        return "messages" if self.messages is not None else "prompt"


def parse_completion(body, vocab: int) -> Parsed:
    b = Body(body, "c")
    b.neutral("add_special_tokens", (None, True), "add_special_tokens must be true on completions (vLLM's "
                                                  "default): leave it out")
    echo = b.boolean("echo", False)
    max_tokens = b.integer("max_tokens", 16, 0 if echo else 1, INT64 - 1)
    prompts = _prompts(b.take("prompt"), vocab)
    logprobs = b.integer("logprobs", None, 0, MAX_LOGPROBS)
    n = b.integer("n", 1, 1, MAX_N)
    best_of = b.integer("best_of", None, 1, INT64 - 1)
    if best_of is not None and best_of != n:
        raise bad(WHY["best_of"] if best_of > n else f"best_of must be >= n ({n}), got {best_of}", "best_of")
    return _common(b, vocab, prompts=prompts, messages=None, max_tokens=max_tokens, n=n, logprobs=logprobs,
                   echo=echo)


def parse_chat(body, vocab: int) -> Parsed:
    b = Body(body, "h")
    messages = _messages(b.take("messages"))
    key = "max_completion_tokens" if b.raw("max_completion_tokens") is not None else "max_tokens"
    max_tokens = b.integer(key, None, 1, INT64 - 1)
    if key == "max_completion_tokens":
        b.integer("max_tokens", None, 1, INT64 - 1)  # checked, superseded
    wants = b.boolean("logprobs", False)
    top = b.integer("top_logprobs", None, 0, MAX_LOGPROBS)
    if top and not wants:
        raise bad("top_logprobs needs logprobs: true (as in vLLM): send both", "top_logprobs")
    b.neutral("echo", (None, False), "echo is not supported on chat completions: leave it out")
    for name, value in (("add_special_tokens", False), ("add_generation_prompt", True),
                        ("continue_final_message", False)):
        b.neutral(name, (None, value), f"{name} must be {str(value).lower()} (vLLM's default): leave it out")
    n = b.integer("n", 1, 1, MAX_N)
    for name in ("prompt_cache_key", "safety_identifier"):
        b.string(name)
    metadata = b.take("metadata")
    if metadata is not None and not (isinstance(metadata, dict)
                                     and all(isinstance(v, str) for v in metadata.values())):
        raise bad("metadata must be an object of strings", "metadata")
    tier = b.take("service_tier")
    if tier is not None and not isinstance(tier, str):
        raise bad("service_tier must be a string", "service_tier")
    b.boolean("parallel_tool_calls", True)
    from .tools import tools_and_choice

    tools, call, name = tools_and_choice(b.take("tools"), b.take("tool_choice"))
    parsed = _common(b, vocab, prompts=None, messages=messages, max_tokens=max_tokens, n=n,
                     logprobs=(top or 0) if wants else None, echo=False, max_key=key)
    if call and parsed.response_format is not None:
        raise bad("response_format cannot be combined with a tool call (tool_choice \"required\" or a named "
                  "function), as vLLM refuses structured outputs with tools: send one of them", "response_format")
    parsed.tools, parsed.tool_call, parsed.tool_name = tools, call, name
    return parsed


def _common(b: "Body", vocab: int, *, prompts, messages, max_tokens, n, logprobs, echo,
            max_key: str = "max_tokens") -> Parsed:
    temperature = b.number("temperature", 1.0, 0.0, 2.0)
    top_p = b.number("top_p", 1.0, 0.0, 1.0, low_open=True)
    top_k = b.integer("top_k", 0, -1, INT64 - 1)
    min_p = b.number("min_p", 0.0, 0.0, 1.0)
    presence = b.number("presence_penalty", 0.0, -2.0, 2.0)
    frequency = b.number("frequency_penalty", 0.0, -2.0, 2.0)
    repetition = b.number("repetition_penalty", 1.0, 0.0, math.inf, low_open=True)
    seed = b.integer("seed", None, -INT64, INT64 - 1)
    bias = _logit_bias(b.take("logit_bias"), vocab)
    if n > 1 and temperature == 0.0:
        raise bad(f"n must be 1 when sampling greedily (temperature 0), got {n} (as in vLLM): raise the "
                  "temperature or send one request", "n")
    try:
        params = SamplingParams(temperature, max(top_k, 0), top_p, None if seed is None else seed % SEED_RANGE,
                                min_p, repetition, presence, frequency, logit_bias=dict(bias))
    except (ConfigError, TypeError) as err:
        message = str(err)
        raise bad(message, message.split(" ")[0].split("[")[0]) from None
    from .tools import response_format

    fmt = response_format(b.take("response_format"))
    stops = _stops(b.take("stop"))
    stop_ids = tuple(_token_ids(b.take("stop_token_ids"), vocab, "stop_token_ids", allow_empty=True) or ())
    stream = b.boolean("stream", False)
    options = b.take("stream_options")
    include_usage = continuous = False
    if options is not None:
        if not isinstance(options, dict):
            raise bad("stream_options must be an object", "stream_options")
        if not stream:
            raise bad("stream_options can only be given with stream: true (as in vLLM)", "stream_options")
        unknown = set(options) - {"include_usage", "continuous_usage_stats"}
        if unknown:
            raise bad(f"stream_options has unknown field(s) {sorted(unknown)}: include_usage and "
                      "continuous_usage_stats are known", "stream_options")
        opts = Body(options, "ch", prefix="stream_options.")
        include_usage = opts.boolean("include_usage", False)
        continuous = opts.boolean("continuous_usage_stats", False)
    b.string("user")
    model = b.take("model")
    if model is not None and not isinstance(model, str):
        raise bad("model must be a string", "model")
    parsed = Parsed(prompts, messages, max_tokens, params, n, stops, stop_ids, logprobs, echo, stream,
                    include_usage, continuous, b.boolean("speculate", True),
                    b.integer("max_draft_tokens", None, 0, INT64 - 1), model, b.boolean("ignore_eos", False),
                    max_key, fmt, grammar_drafting=b.boolean("grammar_drafting", True))
    b.finish()
    return parsed


# -- fields ---------------------------------------------------------------------------------------
def _prompts(prompt, vocab: int) -> list[str | list[int]]:
    """prompt: a string, a list of strings, a list of token ids, or a list of such lists."""
    what = "prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids"
    if isinstance(prompt, str):
        out = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        out = list(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        out = [_token_ids(p, vocab, "prompt") for p in prompt]
    elif isinstance(prompt, list) and prompt:
        out = [_token_ids(prompt, vocab, "prompt")]
    elif prompt is None:
        raise bad("prompt is required: " + what, "prompt")
    else:
        raise bad(what + ", and not empty", "prompt")
    if len(out) > MAX_N:
        raise bad(f"prompt holds {len(out)} prompts; at most {MAX_N} a request", "prompt")
    if any(p == "" for p in out):
        raise bad("prompt is empty: give at least one character or token", "prompt")
    return out


def _token_ids(ids, vocab: int, name: str, allow_empty: bool = False) -> list[int] | None:
    if ids is None and allow_empty:
        return None
    if not isinstance(ids, list) or (not ids and not allow_empty):
        raise bad(f"{name} must be a non-empty list of token ids", name)
    out = []
    for t in ids:
        if isinstance(t, float) and t.is_integer():
            t = int(t)  # 55.0 is the integer 55 (JSON Schema's and pydantic's reading)
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise bad(f"{name} must hold integer token ids, got {show(t)}", name)
        if not 0 <= t < vocab:
            raise bad(f"{name} holds the token id {t}, outside the model's vocabulary [0, {vocab})", name)
        out.append(int(t))
    return out


def _logit_bias(bias, vocab: int) -> list[tuple[int, float]]:
    """OpenAI sends {"253": -100}: keys are token ids as strings (ints are accepted too)."""
    if bias is None:
        return []
    if not isinstance(bias, dict):
        raise bad("logit_bias must be an object {\"token id\": bias}", "logit_bias")
    out = []
    for key, value in bias.items():
        text = str(key)
        if not (text.isascii() and text.isdigit()):
            raise bad(f"logit_bias keys must be token ids written as decimal strings, got {show(key)}", "logit_bias")
        token = int(text)
        if not 0 <= token < vocab:
            raise bad(f"logit_bias names the token id {token}, outside the model's vocabulary [0, {vocab})",
                      "logit_bias")
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not -100 <= value <= 100:
            raise bad(f"logit_bias values must be numbers in [-100, 100], got {show(value)} for {token}",
                      "logit_bias")
        out.append((token, float(value)))
    return out


def _stops(stop) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("stop must be a string or a list of strings", "stop")
    return tuple(dict.fromkeys(s for s in stops if s))  # an empty one is ignored, as LLM.generate and the CLI do


ROLES = ("system", "developer", "user", "assistant", "tool")


def _messages(messages) -> list[dict]:
    from .tools import assistant_calls, tool_message

    if not isinstance(messages, list) or not messages:
        raise bad("messages is required: a non-empty list of {role, content}", "messages")
    checked = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}] must be an object with a string role", "messages")
        role = m["role"]
        if role == "function" or m.get("function_call") is not None:
            raise bad(f"messages[{i}]: function_call and role function are deprecated by OpenAI and not supported: "
                      "send tool_calls and role tool", "messages")
        if role not in ROLES:
            raise bad(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {show(role)}", "messages")
        calls = m.get("tool_calls")
        if calls is not None and role != "assistant":
            raise bad(f"messages[{i}]: only assistant messages hold tool_calls", "messages")
        calls = assistant_calls(i, calls) if calls is not None else None
        if role != "tool":
            unknown = set(m) - {"role", "content", "name", "tool_calls", "function_call"}
            if unknown:
                raise bad(f"messages[{i}] has unknown field(s) {sorted(unknown)}: role, content, name and "
                          "tool_calls are known (tool_call_id with role tool)", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       and set(p) <= {"type", "text"} for p in content):
                raise bad(f"messages[{i}].content parts must be {{type: text, text: string}}: this server "
                          "serves text", "messages")
            content = "".join(p["text"] for p in content)
        if content is None and calls:  # an assistant's tool calls need no text
            content = ""
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content must be a string or a list of text parts", "messages")
        if role == "tool":
            checked.append(tool_message(i, m, content))
            continue
        out = {"role": role, "content": content}
        if m.get("name") is not None:
            if not isinstance(m["name"], str):
                raise bad(f"messages[{i}].name must be a string", "messages")
            out["name"] = m["name"]
        if calls:
            out["tool_calls"] = calls
        checked.append(out)
    return checked
