"""The MTP head kind: DeepSeek-V3's multi-token-prediction module (one decoder layer over [embedding ; target hidden]).

    head.py         the model (fast path: slots, K/V cache, tree masks)   reference.py  the slow one
    format.py       the layout on disk (the module as layer N, vLLM's deepseek_mtp names)
    export.py       writing it (and what vLLM and llama.cpp load)         check.py   `outrider check-head`
    golden.py       its golden measurement (chains fed the text)          cli.py     `outrider export mtp`
    trainable.py    the module `outrider train mtp` trains, and its job

The drafter that runs it is drafters/mtp.py (drafters/eagle3.py's drafter over this head); its
registration as a head kind, heads/kinds.py.
"""
