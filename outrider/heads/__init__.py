"""Learned draft heads: small networks that read the target's hidden states, one package per kind.

A head is its weights plus its forward, in the decoder's style (plain tensors and the functions
of models/layers.py); a drafter in drafters/ wraps a head and keeps its K/V in step with the
committed prefix. Each kind is a package (eagle3/, dflash/: the model, its slow reference, its
format on disk, export, check and golden) over the base shared here: files.py, vocab_map.py,
golden.py + golden_compute.py, checks.py, staging.py, catalog.py, gguf_*.py.
"""
