"""Architectures: the decoder shared by the Llama, Qwen2 and Qwen3 families, and its K/V cache.

    decoder.py     the decoder: ragged slots, tree masks, hidden-state taps, one forward
    layers.py      a layer's arithmetic as plain functions over weight tensors
    batch.py       one forward's input: slots, new tokens, positions, masks
    kv_cache.py    the per-slot preallocated K/V cache (rollback is a length)
    config.py      the model configuration read from config.json
    family.py, families.py, llama.py, qwen2.py, qwen3.py   what tells the families apart
"""
