"""Serving: many requests at once on one target, with speculation inside the batch.

    scheduler.py    which requests hold a slot (limits on running sequences and KV rows)
    engine_loop.py  the step-able engine: admit, prefill a chunk, one round, retire
    api.py          `outrider serve`: the OpenAI-compatible HTTP layer over the engine thread
"""
