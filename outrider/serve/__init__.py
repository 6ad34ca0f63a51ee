"""Serving: the OpenAI-compatible HTTP front end over the engine (engine/loop.py), its worker thread and metrics.

    worker.py       the engine in its own thread; jobs, streamed text, cancellation, draining
    protocol.py     OpenAI request bodies checked field by field; responses and stream chunks
    api.py          the FastAPI app: completions, chat, models, health, metrics, API key
    metrics.py      Prometheus metrics under vLLM's names
    server.py       `outrider serve`: build, run uvicorn, drain on SIGINT/SIGTERM
"""
