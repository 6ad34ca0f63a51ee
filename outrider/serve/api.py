"""The OpenAI-compatible HTTP layer (FastAPI): it checks, tokenizes, enqueues and streams.

    POST /v1/completions        POST /v1/chat/completions   (stream: true -> server-sent events)
    GET  /v1/models             GET  /health                GET  /metrics (Prometheus)
    GET  /openapi.json          the request and response schemas (schema.py)

With an API key every route but /health and /openapi.json needs `Authorization: Bearer KEY`
(compared in constant time). Every error has the OpenAI body `{"error": {"message", "type",
"param", "code"}}`: 400 for a bad body (a body that is not `application/json` too, as vLLM),
401 with `WWW-Authenticate: Bearer`, 404 for another model's name or an unknown route, 429
(with Retry-After) when the queue is full, 500 when the engine failed the request, 503 while
draining or restarting. A request is checked whole before it is queued (protocol.py; token ids
in the vocabulary, prompt + max_tokens within --max-model-len). A handler never waits for the
engine except by awaiting its job's queue, and a non-streaming handler watches for its client's
disconnect at the same time, cancelling its job at once. `response_format` and tool calls (their
grammar, the tools in the prompt, OpenAI's tool_calls shape) are tools.py's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import inspect
import json
import threading
from dataclasses import dataclass, field

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.request import Request
from .metrics import Metrics
from .errors import ApiError
from .protocol import Parsed, parse_chat, parse_completion
from .responses import (chat_logprobs, chunk, completion_logprobs, extensions, new_id, response,
                        usage)
from .schema import (ChatCompletionResponse, CompletionResponse, Health, ModelList, add_request_schemas, errors,
                     request_body, stream)
from . import tools
from .worker import EngineWorker, Job

GOLDEN = 0x9E3779B97F4A7C15  # seeds of n samples: seed + i * GOLDEN (mod 2**64), distinct and spread
OPEN_PATHS = ("/health", "/openapi.json")
ROUTES = "POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics"


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


class ApiKeyGuard:
    """Pure ASGI (no BaseHTTPMiddleware, so a handler's `receive` sees its client's disconnect)."""

    def __init__(self, app, key: str | None):
        self.app = app
        self.expected = f"Bearer {key}".encode() if key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.expected is not None and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                err = ApiError(401, "missing or wrong API key: send Authorization: Bearer KEY", code="invalid_api_key",
                               headers={"WWW-Authenticate": "Bearer"})
                await _error(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="Outrider", version="1", docs_url=None, redoc_url=None, openapi_url="/openapi.json",
                  summary="OpenAI-compatible completions with lossless speculative decoding")
    app.add_middleware(ApiKeyGuard, key=state.api_key)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: HttpRequest, exc: StarletteHTTPException):
        if exc.status_code == 404:
            err = ApiError(404, f"no route {request.method} {request.url.path}: this server has {ROUTES}",
                           code="not_found")
        elif exc.status_code == 405:
            err = ApiError(405, f"{request.method} is not allowed on {request.url.path}: this server has {ROUTES}",
                           code="method_not_allowed", headers=dict(exc.headers or {}))
        else:
            err = ApiError(exc.status_code, str(exc.detail), headers=dict(exc.headers or {}))
        return _error(err)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: HttpRequest, exc: RequestValidationError):
        return _error(ApiError(400, f"invalid request: {exc.errors()[0].get('msg', exc)}"))

    @app.get("/health", response_model=Health, response_model_exclude_none=True, responses={503: {"model": Health, "description": "draining or failed"}})
    async def health():
        if state.worker.failed:
            return JSONResponse({"status": "failed", "error": state.worker.failed}, status_code=503)
        if state.worker.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok", **getattr(state.worker, "health", dict)()}  # a cluster's: its replicas

    @app.get("/metrics", response_class=Response, responses={
        200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "Prometheus text"},
        **errors(401)})
    async def metrics():
        text = state.metrics.exposition()
        if inspect.isawaitable(text):  # a cluster's: gathered from its replicas
            text = await text
        return Response(text, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", response_model=ModelList, responses=errors(401))
    async def models():
        model = {"id": state.model_name, "object": "model", "created": 0, "owned_by": "outrider",
                 "max_model_len": state.worker.engine.max_len}
        return {"object": "list", "data": [model]}

    post = errors(400, 401, 404, 429, 500, 503)

    @app.post("/v1/completions", openapi_extra=request_body("CompletionRequest"),
              responses={200: {"model": CompletionResponse, "content": stream("CompletionChunk"), "description": "the completion"},
                         **post})
    async def completions(request: HttpRequest):
        return await _generate(state, request, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=request_body("ChatCompletionRequest"),
              responses={200: {"model": ChatCompletionResponse, "content": stream("ChatCompletionChunk"), "description": "the reply"},
                         **post})
    async def chat(request: HttpRequest):
        return await _generate(state, request, chat=True)

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
            app.openapi_schema = add_request_schemas(schema, state.vocab, bool(state.api_key))
        return app.openapi_schema

    app.openapi = openapi
    return app


def _error(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _refuse_non_finite(token: str):
    raise ValueError(f"{token} is not a JSON number")


def _check_unicode(body) -> None:
    """Refuse strings JSON allows but Unicode does not (lone surrogates such as "\\udcf3"): they
    cannot be tokenized, nor sent back in a response."""
    todo = [(body, None)]
    while todo:
        value, top = todo.pop()
        if isinstance(value, str):
            value = [value]
        elif isinstance(value, dict):
            todo.extend((k, top if top is not None else k) for k in value)
            todo.extend((v, top if top is not None else k) for k, v in value.items())
            continue
        elif isinstance(value, list):
            todo.extend((v, top) for v in value)
            continue
        else:
            continue
        try:
            value[0].encode("utf-8")
        except UnicodeEncodeError:
            param = top if isinstance(top, str) and top.isprintable() and top.isascii() else None
            raise ApiError(400, "the body holds a string that is not valid Unicode (a lone surrogate such as "
                                "\\udcf3): send UTF-8 text", param) from None


@dataclass
class Plan:
    """A checked request as the engine will run it: one Request a choice."""

    parsed: Parsed
    prompt_ids: list[list[int]]
    prompt_texts: list[str]  # what echo shows
    job: Job

    def prompt_of(self, index: int) -> int:
        return index // self.parsed.n


async def _generate(state: ServerState, http: HttpRequest, chat: bool):
    try:
        media = http.headers.get("content-type", "").split(";")[0].strip().lower()
        if media != "application/json":
            raise ApiError(400, f"the body must be JSON sent as Content-Type: application/json, got "
                                f"{media or 'no Content-Type'} (as vLLM refuses it)", code="unsupported_media_type")
        try:
            body = json.loads(await http.body(), parse_constant=_refuse_non_finite)
        except (ValueError, UnicodeDecodeError, RecursionError) as err:
            raise ApiError(400, f"the request body is not valid JSON ({str(err)[:200]})") from None
        _check_unicode(body)
        parsed = parse_chat(body, state.vocab) if chat else parse_completion(body, state.vocab)
        if parsed.model is not None and parsed.model != state.model_name:
            raise ApiError(404, f"the model '{parsed.model}' does not exist: this server serves "
                                f"'{state.model_name}'", "model", code="model_not_found")
        grammar = await state.structured.grammar(parsed)
        plan = _plan(state, parsed, grammar)
        plan.job.stream = parsed.stream
        plan.job.session = http.headers.get("x-session-id") or (body.get("user") or None)
        plan.job.headers = http.headers  # the cluster's router reads its routing headers (cluster/info.py)
        state.worker.submit(plan.job)
    except ApiError as err:
        return _error(err)
    rid = new_id(chat)
    if parsed.stream:
        return StreamingResponse(_stream(state, plan, rid, chat), media_type="text/event-stream")
    return await _whole(state, http, plan, rid, chat)


def _plan(state: ServerState, parsed: Parsed, grammar=None) -> Plan:
    """Tokenize, check lengths against the context and the K/V rows, and make one Request a choice."""
    engine, vocab = state.worker.engine, state.vocab
    prompts = state.encode(parsed)
    param = parsed.prompt_param
    requests, prefill_from, texts = [], [], []
    for p, ids in enumerate(prompts):
        if not ids:
            raise ApiError(400, "the prompt is empty after tokenization: give at least one token", param)
        if max(ids) >= vocab or min(ids) < 0:
            raise ApiError(400, f"the prompt holds a token id outside the model's vocabulary [0, {vocab})", param)
        if len(ids) >= engine.max_len:
            raise ApiError(400, f"the prompt has {len(ids)} tokens but the context holds {engine.max_len} "
                                "(--max-model-len): shorten the prompt", param)
        max_tokens = parsed.max_tokens if parsed.max_tokens is not None else engine.max_len - len(ids)
        if len(ids) + max_tokens > engine.max_len:
            raise ApiError(400, f"the context holds {engine.max_len} tokens (--max-model-len) but this request "
                                f"needs {len(ids) + max_tokens}: {len(ids)} of prompt and {max_tokens} of "
                                f"{parsed.max_key}; lower {parsed.max_key} or shorten the prompt", parsed.max_key)
        echo_only = parsed.echo and max_tokens == 0
        if parsed.prompts is not None and parsed.echo:
            texts.append(parsed.prompts[p] if isinstance(parsed.prompts[p], str) else state.decode(ids))
        for s in range(parsed.n):
            params = parsed.params
            if s and params.seed is not None:
                params = dataclasses.replace(params, seed=(params.seed + s * GOLDEN) % 2**64)
            prompt_logprobs = parsed.logprobs if parsed.echo and s == 0 else None
            req = Request(list(ids), max(max_tokens, 1), params, parsed.stops, parsed.speculate,
                          parsed.max_draft_tokens, parsed.ignore_eos, stop_token_ids=parsed.stop_token_ids,
                          logprobs=None if echo_only else parsed.logprobs, prompt_logprobs=prompt_logprobs,
                          grammar=grammar, grammar_drafting=parsed.grammar_drafting)
            try:
                engine.check(req)
            except ValueError as err:
                raise ApiError(400, str(err), parsed.max_key) from None
            requests.append(req)
            prefill_from.append(None if s == 0 else p * parsed.n)
    if len(requests) > state.worker.max_queue:
        raise ApiError(400, f"this request asks for {len(requests)} completions but the server queues at most "
                            f"{state.worker.max_queue} (--max-queue): lower n or send fewer prompts", "n")
    return Plan(parsed, prompts, texts, Job(requests, asyncio.get_running_loop(), prefill_from))


def _failed(completion) -> ApiError:
    return ApiError(500, f"the request failed in the engine and was stopped alone: {completion.error or 'no reason'}; "
                         "retry it, or report it if it fails again", kind="server_error", code="request_failed")


async def _disconnected(http: HttpRequest) -> None:
    """Returns when the client goes away (the body has been read, so the next message is that)."""
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            return


async def _whole(state: ServerState, http: HttpRequest, plan: Plan, rid: str, chat: bool):
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
                return _error(value)
            if kind == "done":
                index, completion = value
                if completion.finish_reason == "error":
                    state.worker.cancel(job)
                    return _error(_failed(completion))
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
            return _error(err)
        choices.append(tools.answer(plan.parsed, i, chat, text, c.finish_reason, logprobs))
    use = usage(sum(len(ids) for ids in plan.prompt_ids), out_tokens)
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


async def _stream(state: ServerState, plan: Plan, rid: str, chat: bool):
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
                yield _sse(chunk(rid, model, chat, None, None, use=usage(prompt_tokens, sum(produced))))
        yield "data: [DONE]\n\n"
    finally:
        if len(done) < n_choices:  # the client went away, or a choice failed: free the slots at the next step
            state.worker.cancel(job)


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, allow_nan=False)}\n\n"
