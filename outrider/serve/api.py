"""The OpenAI-compatible HTTP layer (FastAPI): it checks, tokenizes, enqueues and streams.

    POST /v1/completions        POST /v1/chat/completions   (stream: true -> server-sent events)
    GET  /v1/models             GET  /health                GET  /metrics (Prometheus)

With an API key every route but /health needs `Authorization: Bearer KEY`. Errors have the
OpenAI body `{"error": {"message", "type", "param", "code"}}`: 400 for a bad body, 401 for a
missing or wrong key, 404 for another model's name, 429 (with Retry-After) when the queue is
full, 503 while draining. A handler never waits for the engine except by awaiting its job's
queue, and cancels its job when the client goes away.
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, field

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..engine.request import Request
from .metrics import Metrics
from .protocol import ApiError, Parsed, chunk, extension, new_id, parse_chat, parse_completion, response, usage
from .worker import EngineWorker, Job

DISCONNECT_POLL_S = 0.25  # how often a non-streaming handler checks that its client is still there


@dataclass
class ServerState:
    llm: object  # engine.LLM: tokenizer, chat template, target
    worker: EngineWorker
    metrics: Metrics
    model_name: str
    api_key: str | None = None
    # encode (HTTP) and decode (the engine's text streams) share the tokenizer
    tokenizer_lock: threading.Lock = field(default_factory=threading.Lock)

    def encode(self, parsed: Parsed) -> list[int]:
        tok = self.llm.tokenizer
        with self.tokenizer_lock:
            if parsed.messages is None:
                return list(parsed.prompt) if isinstance(parsed.prompt, list) else tok(parsed.prompt)["input_ids"]
            if not getattr(tok, "chat_template", None):
                raise ApiError(400, f"model '{self.model_name}' has no chat template: use /v1/completions")
            text = tok.apply_chat_template(parsed.messages, add_generation_prompt=True, tokenize=False)
            return tok(text, add_special_tokens=False)["input_ids"]


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="Outrider", docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def guard(request: HttpRequest, call_next):
        if state.api_key and request.url.path != "/health":
            if request.headers.get("authorization", "") != f"Bearer {state.api_key}":
                return _error(ApiError(401, "missing or wrong API key: send Authorization: Bearer KEY",
                                       code="invalid_api_key"))
        return await call_next(request)

    @app.get("/health")
    async def health():
        if state.worker.failed:
            return JSONResponse({"status": "failed", "error": state.worker.failed}, status_code=503)
        if state.worker.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.exposition(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        model = {"id": state.model_name, "object": "model", "created": 0, "owned_by": "outrider",
                 "max_model_len": state.worker.engine.max_len}
        return {"object": "list", "data": [model]}

    @app.post("/v1/completions")
    async def completions(request: HttpRequest):
        return await _generate(state, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: HttpRequest):
        return await _generate(state, request, chat=True)

    return app


def _error(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


async def _generate(state: ServerState, http: HttpRequest, chat: bool):
    try:
        try:
            body = json.loads(await http.body())
        except (ValueError, UnicodeDecodeError) as err:
            raise ApiError(400, f"the request body is not valid JSON ({err})") from None
        parsed = parse_chat(body) if chat else parse_completion(body)
        if parsed.model is not None and parsed.model != state.model_name:
            raise ApiError(404, f"the model '{parsed.model}' does not exist: this server serves "
                                f"'{state.model_name}'", "model", code="model_not_found")
        prompt_ids = state.encode(parsed)
        engine = state.worker.engine
        max_tokens = parsed.max_tokens or max(engine.max_len - len(prompt_ids), 1)
        req = Request(prompt_ids, max_tokens, parsed.params, tuple(parsed.stops), parsed.speculate,
                      parsed.max_draft_tokens, parsed.ignore_eos)
        try:
            engine.check(req)
        except ValueError as err:
            raise ApiError(400, str(err), "messages" if chat else "prompt") from None
        job = Job(req, asyncio.get_running_loop())
        state.worker.submit(job)
    except ApiError as err:
        return _error(err)
    rid = new_id(chat)
    if parsed.stream:
        return StreamingResponse(_stream(state, job, rid, chat, parsed.include_usage), media_type="text/event-stream")
    return await _whole(state, http, job, rid, chat)


async def _whole(state: ServerState, http: HttpRequest, job: Job, rid: str, chat: bool):
    while True:
        try:
            kind, item = await asyncio.wait_for(job.queue.get(), DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
            if await http.is_disconnected():
                state.worker.cancel(job)
                return Response(status_code=499)
            continue
        if kind == "error":
            return _error(item)
        if kind == "done":
            use = usage(len(job.request.prompt_ids), len(item.token_ids))
            return response(rid, state.model_name, chat, item.text, item.finish_reason, use, extension(item))


async def _stream(state: ServerState, job: Job, rid: str, chat: bool, include_usage: bool):
    model, done = state.model_name, False
    try:
        if chat:
            yield _sse(chunk(rid, model, chat, "", first=True))
        while True:
            kind, item = await job.queue.get()
            if kind == "text":
                yield _sse(chunk(rid, model, chat, item))
            elif kind == "error":
                done = True
                yield _sse(item.body())
                break
            else:
                done = True
                yield _sse(chunk(rid, model, chat, None if chat else "", item.finish_reason, ext=extension(item)))
                if include_usage:
                    yield _sse(chunk(rid, model, chat, None, use=usage(len(job.request.prompt_ids),
                                                                        len(item.token_ids))))
                break
        yield "data: [DONE]\n\n"
    finally:
        if not done:  # the client went away mid-stream: free the slot at the next step
            state.worker.cancel(job)


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
