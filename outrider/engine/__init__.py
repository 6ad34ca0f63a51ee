"""The engine: the one loop every front end runs (requests, scheduling, rounds, stopping, text).

    request.py      Request in, Completion out: what LLM.generate, the bench and the server exchange
    sequence.py     the one record a request carries from admission to its Completion
    loop.py         EngineLoop: admit, prefill a chunk, one round, retire; step by step
    scheduler.py    which requests hold a K/V slot (continuous batching)
    prefix_cache.py prompts' K/V in blocks keyed by their whole prefix, reused across requests (exact)
    round.py        one speculative round for the batch, top to bottom: propose, constrain, verify,
                    commit, stop, observe; its steps in drafting.py (propose, observe: the drafter
                    and the controller), constrain.py (grammars), verify.py (the one forward and
                    the verifiers) and commit.py (the slot state, tokens, counters)
    speculator.py   drafter + tree shape + controller + verifier, checked up front
    stopping.py     EOS, max new tokens, context and stop strings inside a multi-token round
    text_stream.py  incremental detokenization with stop strings
    generate.py     offline generation of a fixed list of requests
    stats.py        per-request figures (tau, acceptance by position, time split)
    threads.py      the CPU thread count that follows the free cores
"""
