"""The OpenAI-compatible HTTP layer (FastAPI): it checks, tokenizes, enqueues and streams.

    POST /v1/completions        POST /v1/chat/completions   (stream: true -> server-sent events)
    GET  /v1/models             GET  /health                GET  /metrics (Prometheus)
    GET  /openapi.json          the request and response schemas (schema.py)

With an API key every route but /health and /openapi.json needs `Authorization: Bearer KEY`
(compared in constant time). Every error has the OpenAI body `{"error": {"message", "type",
"param", "code"}}`: 400 for a bad body (a body that is not `application/json` too, as vLLM),
401 with `WWW-Authenticate: Bearer`, 404 for another model's name or an unknown route, 429
(with Retry-After) when the queue is full, 500 when the engine failed the request, 503 while
draining or restarting, 413 for a body over --max-body-mb (refused by its Content-Length before it
is read, or as soon as a chunked body passes the limit). A request is checked whole before it is
queued (protocol.py; token ids in the vocabulary, prompt + max_tokens within --max-model-len);
a large body is parsed, and every prompt tokenized, in a worker thread, so that neither holds up
the event loop (/health, the running streams). A handler never waits for the
engine except by awaiting its job's queue, and a non-streaming handler watches for its client's
disconnect at the same time, cancelling its job at once. `response_format` and tool calls (their
grammar, the tools in the prompt, OpenAI's tool_calls shape) are tools.py's. What the handlers
hold (`ServerState`, a request's `Plan`) is state.py's; the answer, whole or streamed, reply.py's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import inspect
import json

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.request import Request
from ..errors import ConfigError
from .errors import ApiError
from .protocol import Parsed, parse_chat, parse_completion
from .reply import error_response, reply_stream, reply_whole
from .responses import new_id
from .schema import (ChatCompletionResponse, CompletionResponse, Health, ModelList, add_request_schemas, errors,
                     request_body, stream)
from .state import Plan, ServerState
from .worker import Job

LARGE_BODY = 1 << 18  # bytes: a body this large is parsed in a worker thread (milliseconds and more)
GOLDEN = 0x9E3779B97F4A7C15  # seeds of n samples: seed + i * GOLDEN (mod 2**64), distinct and spread
OPEN_PATHS = ("/health", "/openapi.json")
ROUTES = "POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics"


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
                await error_response(err)(scope, receive, send)
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
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: HttpRequest, exc: RequestValidationError):
        return error_response(ApiError(400, f"invalid request: {exc.errors()[0].get('msg', exc)}"))

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

    post = errors(400, 401, 404, 413, 429, 500, 503)

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


async def _read_body(http: HttpRequest, limit: int) -> bytes:
    """The body, or a 413 as soon as it is known to exceed `limit` bytes: by its Content-Length
    before any of it is read, or while a chunked one is read."""
    length = http.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise _too_large(f"{int(length)} bytes", limit)
    chunks, size = [], 0
    async for chunk in http.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(f"more than {limit} bytes", limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: str, limit: int) -> ApiError:
    return ApiError(413, f"the request body is {size}, over this server's limit of {limit} bytes "
                         f"({limit / (1 << 20):g} MiB, --max-body-mb): send a shorter prompt, or start the server with "
                         "a higher --max-body-mb", code="request_too_large")


def _parse(raw: bytes, chat: bool, vocab: int) -> tuple[dict, Parsed]:
    try:
        body = json.loads(raw, parse_constant=_refuse_non_finite)
    except (ValueError, UnicodeDecodeError, RecursionError) as err:
        raise ApiError(400, f"the request body is not valid JSON ({str(err)[:200]})") from None
    _check_unicode(body)
    return body, (parse_chat(body, vocab) if chat else parse_completion(body, vocab))


async def _generate(state: ServerState, http: HttpRequest, chat: bool):
    try:
        media = http.headers.get("content-type", "").split(";")[0].strip().lower()
        if media != "application/json":
            raise ApiError(400, f"the body must be JSON sent as Content-Type: application/json, got "
                                f"{media or 'no Content-Type'} (as vLLM refuses it)", code="unsupported_media_type")
        raw = await _read_body(http, state.max_body_bytes)
        if len(raw) >= LARGE_BODY:
            body, parsed = await asyncio.to_thread(_parse, raw, chat, state.vocab)
        else:
            body, parsed = _parse(raw, chat, state.vocab)
        if parsed.model is not None and parsed.model != state.model_name:
            raise ApiError(404, f"the model '{parsed.model}' does not exist: this server serves "
                                f"'{state.model_name}'", "model", code="model_not_found")
        grammar = await state.structured.grammar(parsed)
        prompts = await asyncio.to_thread(state.encode, parsed)  # seconds for a long prompt: off the loop
        plan = _plan(state, parsed, prompts, grammar)
        plan.job.stream = parsed.stream
        plan.job.session = http.headers.get("x-session-id") or (body.get("user") or None)
        plan.job.headers = http.headers  # the cluster's router reads its routing headers (cluster/info.py)
        state.worker.submit(plan.job)
    except ApiError as err:
        return error_response(err)
    rid = new_id(chat)
    if parsed.stream:
        return StreamingResponse(reply_stream(state, plan, rid, chat), media_type="text/event-stream")
    return await reply_whole(state, http, plan, rid, chat)


def _plan(state: ServerState, parsed: Parsed, prompts: list[list[int]], grammar=None) -> Plan:
    """Check the prompts' lengths against the context and the K/V rows, and make one Request a choice."""
    engine, vocab = state.worker.engine, state.vocab
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
            _check_speculation(engine, req)
            requests.append(req)
            prefill_from.append(None if s == 0 else p * parsed.n)
    if len(requests) > state.worker.max_queue:
        raise ApiError(400, f"this request asks for {len(requests)} completions but the server queues at most "
                            f"{state.worker.max_queue} (--max-queue): lower n or send fewer prompts", "n")
    return Plan(parsed, prompts, texts, Job(requests, asyncio.get_running_loop(), prefill_from))


def _check_speculation(engine, req: Request) -> None:
    """Refuse, naming `temperature`, a request this server's speculation cannot verify: a sampled
    tree (--tree sampled:...) when greedy, or a --verifier that does not fit its sampling."""
    spec = getattr(engine, "speculation", None)  # a cluster's router: each replica checks its own
    if spec is None or not req.speculate or req.max_draft_tokens == 0:
        return
    tree = spec.options.tree
    if spec.options.shape.kind == "sampled" and req.params.greedy:
        raise ApiError(400, f"this server drafts with --tree {tree}, which draws its draft siblings from the "
                            "drafter's distribution and so needs temperature > 0: send a temperature above 0, or "
                            "speculate: false to decode this greedy request without drafts", "temperature")
    try:
        spec.verifier_for(req.params)
    except ConfigError as err:
        raise ApiError(400, f"this server's speculation cannot verify these sampling parameters ({err}): send "
                            "another temperature, or speculate: false to decode without drafts",
                       "temperature") from None
