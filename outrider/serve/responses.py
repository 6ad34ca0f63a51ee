"""OpenAI response bodies and stream chunks, from the engine's Completions and Events.

Logprobs take OpenAI's two shapes, as vLLM fills them (the target's raw distribution):
completions `{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}` (each top
dict also holds the chosen token, so it has up to N + 1 entries; an echoed prompt's first token
has null), chat `{content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}`.
A log-probability below -9999 (or -inf) is sent as -9999.0, as vLLM does: JSON has no -inf.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Callable

OPENAI_REASON = {"eos": "stop", "stop": "stop", "length": "length", "context": "length", "cancelled": "abort",
                 "error": "error", "tool_calls": "tool_calls"}
FLOOR = -9999.0

TokenText = Callable[[int], str]  # a token id's text (the tokenizer's decode of that one id)


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """OpenAI's usage; with `cached_tokens` (known when the choices have ended), its
    prompt_tokens_details: the prompt tokens whose K/V came from the prefix cache."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def cached_tokens(completions: list, n: int) -> int:
    """The prompt tokens the prefix cache gave, over the prompts (each prompt's first choice: the
    others copy its prefill), as prompt_tokens counts each prompt once."""
    return sum(getattr(c, "cached_tokens", 0) for c in completions[::n])


def extension(completion) -> dict:
    """One choice's `outrider` figures: its own speculation (engine Completion)."""
    s, reason = completion.stats, completion.finish_reason
    return {"tau": s.get("mean_accepted_length", 0.0), "rounds": s.get("rounds", 0), "drafted": s.get("drafted", 0),
            "accepted": sum(s.get("accepted_by_position", ())),
            "accepted_by_position": s.get("accepted_by_position", []),
            "draft_rounds": (s.get("proposed_by_position") or [0])[0],
            "acceptance_by_position": s.get("acceptance_by_position", []), "finish_reason": reason}


def extensions(completions: list) -> dict:
    """The response's `outrider` field: one choice's figures, or {"choices": [...]} for several."""
    if len(completions) == 1:
        return extension(completions[0])
    return {"choices": [extension(c) for c in completions]}


def _lp(x: float) -> float:
    return FLOOR if not math.isfinite(x) or x < FLOOR else float(x)


def completion_logprobs(entries: list, text_of: TokenText, offset: int = 0) -> dict:
    """Legacy completions logprobs of `entries` (TokenLogprob, or None for a prompt's first
    token, which has none: then its id is in the entry's place as an int)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for entry in entries:
        if isinstance(entry, int):  # a token with no logprob: the prompt's first
            token, logprob, top = text_of(entry), None, None
        else:
            token, logprob = text_of(entry.token), _lp(entry.logprob)
            top = {text_of(t): _lp(lp) for t, lp in entry.top}
            top.setdefault(token, logprob)
        out["tokens"].append(token)
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(token)
    return out


def chat_logprobs(entries: list, text_of: TokenText, top_n: int) -> dict:
    def item(token_id: int, logprob: float) -> dict:
        text = text_of(token_id)
        return {"token": text, "logprob": _lp(logprob), "bytes": list(text.encode("utf-8", errors="replace"))}

    return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top[:top_n]]}
                        for e in entries]}


def choice(index: int, chat: bool, text: str, reason: str | None, logprobs: dict | None) -> dict:
    finish = OPENAI_REASON[reason] if reason else None
    if chat:
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                "finish_reason": finish}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


def response(rid: str, model: str, chat: bool, choices: list[dict], use: dict, ext: dict) -> dict:
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": use, "outrider": ext}


def chunk(rid: str, model: str, chat: bool, index: int | None, text: str | None, reason: str | None = None, *,
          first: bool = False, logprobs: dict | None = None, use: dict | None = None,
          ext: dict | None = None, delta: dict | None = None) -> dict:
    """One server-sent event's payload: choice `index`'s new text (chat: or `delta`, a tool
    call); `index` None with `use` is the final usage chunk (no choices)."""
    out = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
           "created": int(time.time()), "model": model}
    if index is None:
        out["choices"] = []
    else:
        finish = OPENAI_REASON[reason] if reason else None
        if chat:
            if delta is None:
                delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
            out["choices"] = [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]
        else:
            out["choices"] = [{"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}]
    if use is not None:
        out["usage"] = use
    if ext is not None:
        out["outrider"] = ext
    return out
