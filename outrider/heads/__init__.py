"""Learned draft heads: small networks that read the target's hidden states, one package per kind.

A head is its weights plus its forward, in the decoder's style (plain tensors and the functions
of models/layers.py); a drafter in drafters/ wraps a head and keeps its K/V in step with the
committed prefix. Each kind is a package (eagle3/, dflash/: the model, its slow reference, its
trainable module, its format on disk, export, check and golden) registered in kinds.py, over the
base shared here: files.py, taps.py, layer.py, vocab_map.py, trainable.py, golden.py +
golden_compute.py, checks.py, staging.py, catalog.py, gguf_*.py.
"""
