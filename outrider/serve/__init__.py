"""Serving: the OpenAI-compatible HTTP front end over the engine (engine/loop.py), its worker thread and metrics.

    worker.py       the engine in its own thread; jobs of one or more choices, streamed text,
                    cancellation, draining, per-request and fatal failures
    protocol.py     OpenAI request bodies checked field by field (FIELDS: what each is)
    responses.py    OpenAI responses, stream chunks and logprobs from the engine's Completions
    schema.py       the OpenAPI schema published at /openapi.json (pydantic models)
    api.py          the FastAPI app: completions, chat, models, health, metrics, API key
    metrics.py      Prometheus metrics under vLLM's names
    server.py       `outrider serve`: build, run uvicorn, drain on SIGINT/SIGTERM
"""
