"""A queued job's answer: awaited whole (one OpenAI response) or streamed (server-sent events).

`reply_whole` awaits every choice's Completion while watching for its client's disconnect (a
client gone cancels the job at once: 499), then answers one response; `reply_stream` sends each
choice's text as it becomes stable, its finish chunk and the usage, holding the chunks when
echo's prompt logprobs come only with the Completions. A request the engine failed alone is a
500, and so is a missing logprobs; `error_response` is any `ApiError` as its JSON response.
"""

from __future__ import annotations

import asyncio
import json

from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response

from .errors import ApiError
from .responses import cached_tokens, chat_logprobs, chunk, completion_logprobs, extensions, response, usage
from . import tools
from .state import Plan, ServerState


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _failed(completion) -> ApiError:
    return ApiError(500, f"the request failed in the engine and was stopped alone: {completion.error or 'no reason'}; "
                         "retry it, or report it if it fails again", kind="server_error", code="request_failed")


async def _disconnected(http: HttpRequest) -> None:
    """Returns when the client goes away (the body has been read, so the next message is that)."""
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            return


async def reply_whole(state: ServerState, http: HttpRequest, plan: Plan, rid: str, chat: bool):
    job = plan.job
    done: dict[int, object] = {}
    gone = asyncio.ensure_future(_disconnected(http))
    try:
        while len(done) < len(job.requests):
            item = asyncio.ensure_future(job.queue.get())
            await asyncio.wait({item, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not item.done():
                item.cancel()
                state.worker.cancel(job)  # the client went away: free the slots at the next step
                return Response(status_code=499)
            kind, value = item.result()
            if kind == "error":
                return error_response(value)
            if kind == "done":
                index, completion = value
                if completion.finish_reason == "error":
                    state.worker.cancel(job)
                    return error_response(_failed(completion))
                done[index] = completion
    finally:
        gone.cancel()
    completions = [done[i] for i in range(len(job.requests))]
    choices, out_tokens = [], 0
    echo_only = plan.parsed.echo and plan.parsed.max_tokens == 0
    for i, c in enumerate(completions):
        text = "" if echo_only else c.text
        out_tokens += 0 if echo_only else len(c.token_ids)
        if plan.parsed.echo:
            text = plan.prompt_texts[plan.prompt_of(i)] + text
        try:
            logprobs = _logprobs(state, plan, i, c, completions, echo_only)
        except ApiError as err:
            return error_response(err)
        choices.append(tools.answer(plan.parsed, i, chat, text, c.finish_reason, logprobs))
    use = usage(sum(len(ids) for ids in plan.prompt_ids), out_tokens, cached_tokens(completions, plan.parsed.n))
    return response(rid, state.model_name, chat, choices, use, extensions(completions))


def _logprobs(state: ServerState, plan: Plan, i: int, c, completions: list, echo_only: bool) -> dict | None:
    parsed = plan.parsed
    if parsed.logprobs is None:
        return None
    entries = [] if echo_only else c.logprobs
    if entries is None:
        raise _missing_logprobs()
    if parsed.messages is not None:
        return chat_logprobs(entries, state.token_text, parsed.logprobs)
    if parsed.echo:  # the prompt's logprobs, computed once per prompt (its first choice)
        first = completions[plan.prompt_of(i) * parsed.n]
        ids = plan.prompt_ids[plan.prompt_of(i)]
        prompt = first.prompt_logprobs
        if prompt is None and len(ids) == 1:  # a one-token prompt: its token has no logprob
            prompt = [None]
        if prompt is None or len(prompt) != len(ids):
            raise _missing_logprobs()
        entries = [lp if lp is not None else t for lp, t in zip(prompt, ids)] + list(entries)
    return completion_logprobs(entries, state.token_text)


def _missing_logprobs() -> ApiError:
    return ApiError(500, "the engine returned no logprobs for a request that asked for them (an engine without "
                         "logprobs support): leave logprobs out", kind="server_error", code="internal_error")


async def reply_stream(state: ServerState, plan: Plan, rid: str, chat: bool):
    """Server-sent events: each choice's text as it becomes stable, its finish chunk, the usage.
    With echo and logprobs the prompt's logprobs come only with the Completion, so the chunks are
    held and sent, prompt first, when every choice has ended."""
    parsed, job, model = plan.parsed, plan.job, state.model_name
    n_choices = len(job.requests)
    prompt_tokens = sum(len(ids) for ids in plan.prompt_ids)
    echo_only = parsed.echo and parsed.max_tokens == 0
    hold = parsed.echo and parsed.logprobs is not None
    produced = [0] * n_choices  # output tokens so far, by choice
    sent_logprobs = [0] * n_choices
    offsets = [0] * n_choices  # completions' text_offset so far: after the echoed prompt's tokens
    if hold:
        offsets = [sum(len(state.token_text(t)) for t in plan.prompt_ids[plan.prompt_of(i)]) for i in range(n_choices)]
    held: list[dict] = []
    done: dict[int, object] = {}

    def running_usage() -> dict | None:
        return usage(prompt_tokens, sum(produced)) if parsed.continuous_usage else None

    def lp_payload(i: int, entries: list) -> dict | None:
        if parsed.logprobs is None or not entries:
            return None
        if chat:
            return chat_logprobs(entries, state.token_text, parsed.logprobs)
        out = completion_logprobs(entries, state.token_text, offsets[i])
        offsets[i] += sum(len(t) for t in out["tokens"])
        return out

    def emit(payload: dict) -> str | None:
        if hold:
            held.append(payload)
            return None
        return _sse(payload)

    try:
        if chat:
            for i in range(n_choices):
                yield _sse(chunk(rid, model, chat, i, "", first=True, use=running_usage()))
        elif parsed.echo and not hold:
            for i in range(n_choices):
                yield _sse(chunk(rid, model, chat, i, plan.prompt_texts[plan.prompt_of(i)], use=running_usage()))
        while len(done) < n_choices:
            kind, item = await job.queue.get()
            if kind == "error":
                yield _sse(item.body())
                break
            if kind == "update":
                if echo_only:
                    continue
                produced[item.index] += item.tokens
                if parsed.tool_call:  # a tool call is sent whole when its choice ends
                    continue
                entries = item.logprobs or []
                sent_logprobs[item.index] += len(entries)
                logprobs = lp_payload(item.index, entries)
                if item.text or logprobs is not None:
                    out = emit(chunk(rid, model, chat, item.index, item.text, logprobs=logprobs, use=running_usage()))
                    if out:
                        yield out
                continue
            index, completion = item
            if completion.finish_reason == "error":
                yield _sse(_failed(completion).body())
                break
            if parsed.logprobs is not None and not echo_only and completion.logprobs is None:
                yield _sse(_missing_logprobs().body())
                break
            done[index] = completion
            if parsed.tool_call:
                logprobs = lp_payload(index, completion.logprobs or [])
                for payload in tools.stream_end(parsed, rid, model, index, completion, logprobs, running_usage(),
                                                extensions([completion])):
                    yield _sse(payload)
                continue
            rest = None if echo_only or parsed.logprobs is None else \
                lp_payload(index, completion.logprobs[sent_logprobs[index]:])
            out = emit(chunk(rid, model, chat, index, None if chat else "", completion.finish_reason, logprobs=rest,
                             use=running_usage(), ext=extensions([completion])))
            if out:
                yield out
        else:
            if hold:  # the echoed prompts with their logprobs, then what was held
                completions = [done[i] for i in range(n_choices)]
                try:
                    prompts = [chunk(rid, model, chat, i, plan.prompt_texts[plan.prompt_of(i)],
                                     logprobs=_logprobs(state, plan, i, completions[i], completions, True),
                                     use=running_usage())
                               for i in range(n_choices)]
                except ApiError as err:
                    prompts, held = [err.body()], []
                for payload in prompts + held:
                    yield _sse(payload)
            if parsed.include_usage:
                cached = cached_tokens([done[i] for i in range(n_choices)], parsed.n)
                yield _sse(chunk(rid, model, chat, None, None, use=usage(prompt_tokens, sum(produced), cached)))
        yield "data: [DONE]\n\n"
    finally:
        if len(done) < n_choices:  # the client went away, or a choice failed: free the slots at the next step
            state.worker.cancel(job)


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, allow_nan=False)}\n\n"
