"""The DFlash head kind: a block drafter proposing B-1 tokens in one forward over the target's features.

    head.py         the model (fast path: slots, cached context)          reference.py  the slow one
    format.py       z-lab's, vLLM's and SGLang's layouts on disk
    export.py       writing them                          check.py   `outrider check-head`
    golden.py       its golden measurement (blocks replayed on the text)  vocab.py   `vocab=N`
    trainable.py    the module `outrider train dflash` trains, and its job     cli.py     `outrider export dflash`
    gguf.py         the GGUF llama.cpp loads (`--format gguf`; the shared part: heads/gguf_layout.py)

The drafter that runs it is drafters/dflash.py (block.py, refiners/); its registration as a head
kind, heads/kinds.py.
"""
