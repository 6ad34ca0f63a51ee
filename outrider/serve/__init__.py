"""Serving: the OpenAI-compatible HTTP front end over the engine (engine/loop.py), its worker thread and metrics.

    worker.py       the engine in its own thread; jobs of one or more choices, streamed text,
                    cancellation, draining, per-request and fatal failures
    protocol.py     OpenAI request bodies checked field by field into a `Parsed`
    fields.py       the field table (FIELDS: what each route does with each field), the limits, and
                    `Body`, which takes a body's fields one by one and refuses the rest
    responses.py    OpenAI responses, stream chunks and logprobs from the engine's Completions
    schema.py       the OpenAPI schema published at /openapi.json (pydantic models)
    api.py          the FastAPI app: completions, chat, models, health, metrics, API key; a request
                    read, checked, tokenized and queued (its `Plan`)
    state.py        what the handlers hold: `ServerState` (LLM, worker, tokenizer) and a request's `Plan`
    reply.py        a queued job's answer: awaited whole, or streamed as server-sent events
    metrics.py      Prometheus metrics under vLLM's names
    server.py       `outrider serve`: build, run uvicorn, drain on SIGINT/SIGTERM
"""
