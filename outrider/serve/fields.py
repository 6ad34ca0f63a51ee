"""The fields of OpenAI's request bodies: what each route does with each, and `Body`, which reads them.

`FIELDS` names every field either route knows: its routes, whether it is honoured, accepted at
its neutral value only or accepted with no effect, and a note (the source of docs/serving.md's
table). `Body` takes a body's fields one by one, each checked for type and range, and `finish`
refuses the rest: a neutral-only field at another value (`WHY` says what to send instead),
another route's field, a field this server does not know. The limits (`MAX_LOGPROBS`, `MAX_N`,
`INT64`, `SEED_RANGE`) are protocol.py's and schema.py's.
"""

from __future__ import annotations

import math
import numbers

from .errors import bad, show

MAX_BODY_MB = 4  # the default request body limit (serve --max-body-mb), in MiB: hundreds of thousands of tokens

MAX_LOGPROBS = 20  # vLLM's --max-logprobs default; OpenAI's top_logprobs limit
MAX_N = 128  # choices per request (n x prompts)
INT64 = 2**63
SEED_RANGE = 2**64  # SamplingParams seeds are in [0, 2**64): an int64 seed is taken modulo this


# -- the field table: what each route does with every field it knows ----------------------------
HONOURED = "honoured"
NEUTRAL = "neutral only"  # accepted at its neutral value, refused otherwise
IGNORED = "accepted, no effect"  # does not change the output (user, metadata ...)

# field -> (what, the neutral value or a note); "c": completions only, "h": chat only
FIELDS: dict[str, tuple[str, str, str]] = {
    # field: (routes, treatment, note for the docs table)
    "model": ("ch", HONOURED, "optional, as in vLLM (OpenAI requires it): when given, it must name the served "
                              "model (404 otherwise)"),
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
    "stop": ("ch", HONOURED, "a string or a list of strings (empty ones ignored, as LLM.generate and the CLI do); "
                             "the text ends before the earliest"),
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
                                        "follows the grammar (llguidance), speculative or not; objects closed "
                                        "unless the schema opens them or strict is false"),
    "tools": ("h", HONOURED, "function tools {type: function, function: {name, description?, parameters?, "
                             "strict?}}; arguments strict unless strict is false"),
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


# -- a body, read field by field ------------------------------------------------------------------
class Body:
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
