"""Learned draft heads: small networks that read the target's hidden states (EAGLE-3 first).

A head is its weights plus its forward, in the decoder's style (plain tensors and the functions
of models/layers.py); a drafter in drafters/ wraps a head and keeps its K/V in step with the
committed prefix. Each head's on-disk format lives beside it (eagle3_format.py).
"""
