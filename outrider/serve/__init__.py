"""Serving: many requests at once on one target, with speculation inside the batch.

    scheduler.py    which requests hold a slot (limits on running sequences and reserved K/V rows)
    engine/loop.py  the step-able engine: admit, prefill a chunk, one round, retire
    worker.py       the engine in its own thread; jobs, streamed text, cancellation, draining
    protocol.py     OpenAI request bodies checked field by field; responses and stream chunks
    api.py          the FastAPI app: completions, chat, models, health, metrics, API key
    metrics.py      Prometheus metrics under vLLM's names
    server.py       `outrider serve`: build, run uvicorn, drain on SIGINT/SIGTERM
"""
