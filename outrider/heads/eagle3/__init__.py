"""The EAGLE-3 head kind: one decoder layer over [embedding ; fused target features], drafting a chain or tree.

    head.py         the model (fast path: slots, K/V cache, tree masks)   reference.py  the slow one
    format.py       the EAGLE / SpecForge layout on disk (speculators.py: vllm-project/speculators')
    export.py       writing it for vLLM and SGLang       check.py   `outrider check-head`
    golden.py       its golden measurement (chains fed the text)          vocab.py   `vocab=N`
    trainable.py    the module `outrider train eagle3` trains, and its job     cli.py     `outrider export eagle3`
    gguf.py         the GGUF llama.cpp loads (`--format gguf`; the shared part: heads/gguf_layout.py)

The drafter that runs it is drafters/eagle3.py; its registration as a head kind, heads/kinds.py.
"""
