"""OpenAI request bodies, checked field by field before anything reaches the engine.

`parse_completion(body, vocab)` / `parse_chat(body, vocab)` return a `Parsed` or raise `ApiError`
(the HTTP status and the OpenAI error body `{"error": {"message", "type", "param", "code"}}`,
`param` naming the field). Every field of OpenAI's two routes is either honoured or refused
with a 400 that says what to send instead; none is ignored, and a field this server does not
know at all is refused too (docs/serving.md has the table, `FIELDS` below is its source).
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
from .errors import ApiError, bad, show

MAX_LOGPROBS = 20  # vLLM's --max-logprobs default; OpenAI's top_logprobs limit
MAX_N = 128  # choices per request (n x prompts)
INT64 = 2**63
SEED_RANGE = 2**64  # SamplingParams seeds are in [0, 2**64): an int64 seed is taken modulo this


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


# -- the field table: what each route does with every field it knows ----------------------------
HONOURED = "honoured"
NEUTRAL = "neutral only"  # accepted at its neutral value, refused otherwise
IGNORED = "accepted, no effect"  # does not change the output (user, metadata ...)

# field -> (what, the neutral value or a note); "c": completions only, "h": chat only
FIELDS: dict[str, tuple[str, str, str]] = {
    # field: (routes, treatment, note for the docs table)
    "model": ("ch", HONOURED, "must name the served model (404 otherwise)"),
    "prompt": ("c", HONOURED, "a string, a list of strings, token ids or lists of token ids (ids in the vocabulary)"),
    "messages": ("h", HONOURED, "roles system, developer, user, assistant; text content or text parts; `name`"),
    "max_tokens": ("ch", HONOURED, "prompt + max_tokens must fit --max-model-len (400 otherwise, as vLLM); "
                                    "completions default 16, chat: what the context holds"),
    "max_completion_tokens": ("h", HONOURED, "as max_tokens; wins when both are given"),
    "temperature": ("ch", HONOURED, "[0, 2]; 0 is greedy; default 1"),
    "top_p": ("ch", HONOURED, "(0, 1]"),
    "top_k": ("ch", HONOURED, "vLLM extension: -1 or 0 turn it off"),
    "min_p": ("ch", HONOURED, "vLLM extension: [0, 1]"),
    "presence_penalty": ("ch", HONOURED, "[-2, 2]"),
    "frequency_penalty": ("ch", HONOURED, "[-2, 2]"),
    "repetition_penalty": ("ch", HONOURED, "vLLM extension: > 0, 1 is off"),
    "logit_bias": ("ch", HONOURED, "{\"token id\": bias in [-100, 100]}, ids in the vocabulary"),
    "seed": ("ch", HONOURED, "any int64 (taken modulo 2**64); n > 1 derives one seed per choice"),
    "n": ("ch", HONOURED, f"1..{MAX_N} samples sharing one prefill; needs temperature > 0 (vLLM refuses n > 1 "
                          "when greedy)"),
    "best_of": ("c", NEUTRAL, "null or equal to n (vLLM V1 refuses best_of > 1 too: it would rank samples "
                              "server-side)"),
    "stop": ("ch", HONOURED, "a string or a list of non-empty strings; the text ends before the earliest"),
    "stop_token_ids": ("ch", HONOURED, "vLLM extension: token ids that end the output (kept)"),
    "stream": ("ch", HONOURED, "server-sent events"),
    "stream_options": ("ch", HONOURED, "include_usage, continuous_usage_stats (vLLM); only with stream"),
    "logprobs": ("ch", HONOURED, "completions: an int 0..20 (the top N per token); chat: true/false"),
    "top_logprobs": ("h", HONOURED, "0..20, with logprobs: true (as vLLM)"),
    "echo": ("ch", HONOURED, "completions: the prompt before the output (with logprobs: the prompt's); "
                             "max_tokens 0 with echo returns the prompt alone; chat: false only (vLLM's "
                             "chat echo is not OpenAI's)"),
    "suffix": ("c", NEUTRAL, "null only: vLLM refuses it too (the models have no fill-in-the-middle here)"),
    "user": ("ch", IGNORED, "a string; does not change the output"),
    "metadata": ("h", IGNORED, "an object of strings; does not change the output"),
    "service_tier": ("h", IGNORED, "accepted; there is one tier"),
    "store": ("h", NEUTRAL, "false or null: nothing is stored"),
    "prompt_cache_key": ("h", IGNORED, "a string; a routing hint"),
    "safety_identifier": ("h", IGNORED, "a string; does not change the output"),
    "response_format": ("ch", HONOURED, "text, json_object, json_schema {name, schema, strict?}: the output "
                                        "follows the grammar (llguidance), speculative or not"),
    "tools": ("h", HONOURED, "function tools {type: function, function: {name, description?, parameters?}}"),
    "tool_choice": ("h", HONOURED, "\"none\", \"required\" or a named function: one call under a grammar; "
                                   "\"auto\" (the default with tools) refused as vLLM without a tool parser"),
    "parallel_tool_calls": ("h", IGNORED, "true/false; one call is produced"),
    "functions": ("h", NEUTRAL, "null only (deprecated by OpenAI for tools)"),
    "function_call": ("h", NEUTRAL, "null only (deprecated by OpenAI for tool_choice)"),
    "modalities": ("h", NEUTRAL, "[\"text\"] only"),
    "audio": ("h", NEUTRAL, "null only: text models"),
    "prediction": ("h", NEUTRAL, "null only: predicted outputs are not supported (yet)"),
    "reasoning_effort": ("h", NEUTRAL, "null only: no reasoning models here"),
    "verbosity": ("h", NEUTRAL, "null only"),
    "web_search_options": ("h", NEUTRAL, "null only: no web search"),
    "ignore_eos": ("ch", HONOURED, "vLLM extension: run past end-of-sequence tokens"),
    "speculate": ("ch", HONOURED, "Outrider: false decodes this request without drafts"),
    "max_draft_tokens": ("ch", HONOURED, "Outrider: at most this many draft tokens a round (0: none)"),
    "grammar_drafting": ("ch", HONOURED, "Outrider: false: the grammar only masks the target (no pruned "
                                         "drafts, no forced tokens)"),
    "min_tokens": ("ch", NEUTRAL, "vLLM extension: 0 only"),
    "include_stop_str_in_output": ("ch", NEUTRAL, "vLLM extension: false only"),
    "skip_special_tokens": ("ch", NEUTRAL, "vLLM extension: true only"),
    "spaces_between_special_tokens": ("ch", NEUTRAL, "vLLM extension: true only"),
    "add_special_tokens": ("ch", NEUTRAL, "vLLM extension: its default only (completions true, chat false)"),
    "add_generation_prompt": ("h", NEUTRAL, "vLLM extension: true only"),
    "continue_final_message": ("h", NEUTRAL, "vLLM extension: false only"),
    "use_beam_search": ("ch", NEUTRAL, "vLLM extension: false only"),
    "length_penalty": ("ch", NEUTRAL, "vLLM extension: 1 only"),
    "prompt_logprobs": ("ch", NEUTRAL, "vLLM extension: null only (use echo with logprobs)"),
    "priority": ("ch", NEUTRAL, "vLLM extension: 0 only"),
}
# the neutral values (a field in NEUTRAL whose value equals one of these is accepted)
NEUTRAL_VALUES: dict[str, tuple] = {
    "best_of": (None,), "suffix": (None,), "store": (None, False), "functions": (None,), "function_call": (None,),
    "modalities": (None, ["text"]), "audio": (None,), "prediction": (None,), "reasoning_effort": (None,),
    "verbosity": (None,), "web_search_options": (None,),
    "min_tokens": (None, 0), "include_stop_str_in_output": (None, False), "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True),
    "use_beam_search": (None, False), "length_penalty": (None, 1, 1.0),
    "prompt_logprobs": (None,), "priority": (None, 0),
}
WHY = {
    "best_of": "best_of must be null or equal to n: ranking samples server-side is not supported (vLLM V1 "
               "refuses it too); use n",
    "suffix": "suffix is not supported (vLLM refuses it too): send the text before the gap as prompt",
    "functions": "functions are not supported (deprecated by OpenAI): send tools",
    "function_call": "function_call is not supported (deprecated by OpenAI): send tool_choice",
    "store": "store is not supported (nothing is stored): leave it out or send false",
    "modalities": "modalities other than [\"text\"] are not supported: this server serves text",
    "audio": "audio output is not supported: leave audio out",
    "prediction": "prediction (predicted outputs) is not supported: leave it out",
}


def parse_completion(body, vocab: int) -> Parsed:
    b = _Body(body, "c")
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
    b = _Body(body, "h")
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


def _common(b: "_Body", vocab: int, *, prompts, messages, max_tokens, n, logprobs, echo,
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
        opts = _Body(options, "ch", prefix="stream_options.")
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
class _Body:
    """A JSON object whose fields are taken one by one; `finish` refuses the rest."""

    def __init__(self, body, routes: str, prefix: str = ""):
        if not isinstance(body, dict):
            raise bad("the request body must be a JSON object")
        self.body, self.routes, self.prefix = body, routes, prefix
        self.seen: set[str] = set()

    def raw(self, key: str):
        return self.body.get(key)

    def take(self, key: str):
        self.seen.add(key)
        return self.body.get(key)

    def integer(self, key: str, default, low: int, high: int):
        value = self.take(key)
        if value is None:
            return default
        name = self.prefix + key
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            if isinstance(value, float) and value.is_integer() and low <= value <= high:
                return int(value)  # 16.0 is 16, as Python's and pydantic's lax mode read it
            raise bad(f"{name} must be an integer, got {show(value)}", name)
        if not low <= value <= high:
            raise bad(f"{name} must be in [{low}, {_bound(high)}], got {value}", name)
        return int(value)

    def number(self, key: str, default: float, low: float, high: float, low_open: bool = False) -> float:
        value = self.take(key)
        if value is None:
            return default
        name = self.prefix + key
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise bad(f"{name} must be a number, got {show(value)}", name)
        value = float(value)
        if not (math.isfinite(value) and (low < value if low_open else low <= value) and value <= high):
            interval = f"{'(' if low_open else '['}{_bound(low)}, {_bound(high)}{')' if high == math.inf else ']'}"
            raise bad(f"{name} must be a finite number in {interval}, got {value}", name)
        return value

    def boolean(self, key: str, default: bool) -> bool:
        value = self.take(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise bad(f"{self.prefix + key} must be true or false, got {show(value)}", self.prefix + key)
        return value

    def string(self, key: str) -> str | None:
        value = self.take(key)
        if value is not None and not isinstance(value, str):
            raise bad(f"{key} must be a string, got {show(value)}", key)
        return value

    def neutral(self, key: str, allowed: tuple, why: str) -> None:
        value = self.take(key)
        if not any(_same(value, a) for a in allowed):
            raise bad(why, key)

    def finish(self) -> None:
        for key in self.body:
            if key in self.seen:
                continue
            spec = FIELDS.get(key)
            if spec is not None and self.routes in spec[0] and spec[1] == NEUTRAL:
                why = WHY.get(key) or f"{key} is not supported: leave it out ({spec[2]})"
                self.neutral(key, NEUTRAL_VALUES[key], why)
                continue
            if spec is not None and self.routes not in spec[0]:
                other = "/v1/chat/completions" if "h" in spec[0] else "/v1/completions"
                raise bad(f"{key} is not a field of this route (it belongs to {other}): leave it out", key)
            raise bad(f"unknown field {key!r}: this server does not know it, so it cannot honour it; leave "
                      "it out (docs/serving.md lists the fields)", key)


def _same(value, allowed) -> bool:
    """JSON equality: true is not 1, 1 is 1.0."""
    if isinstance(allowed, bool) or isinstance(value, bool):
        return value is allowed
    if isinstance(value, numbers.Real) and isinstance(allowed, numbers.Real):
        return value == allowed
    return type(value) is type(allowed) and value == allowed


def _bound(x) -> str:
    if x == math.inf:
        return "inf"
    if isinstance(x, int) and abs(x) >= 2**62:
        return ("-" if x < 0 else "") + ("2**63" if abs(x) == INT64 else "2**63 - 1")
    return f"{x:g}" if isinstance(x, float) else str(x)


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
    if any(s == "" for s in stops):
        raise bad("stop cannot hold an empty string (as in vLLM): leave it out", "stop")
    return tuple(dict.fromkeys(stops))


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
