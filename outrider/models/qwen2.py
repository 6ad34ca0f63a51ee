"""Qwen2 family (Qwen2, Qwen2.5, Qwen2.5-Coder): biases on the Q, K and V projections.

Sliding windows as transformers' Qwen2 applies them: only with `use_sliding_window: true` (false in
every released Qwen2 / 2.5 config), on the layers `layer_types` names "sliding_attention", or, where
it is absent, on layers max_window_layers and after; a query at position p sees keys at positions
> p - sliding_window (models/sliding.py: masked by position; the rows a window no longer reads
freed, models/ring_cache.py).
"""

from ..errors import ModelError
from .family import Family

SLIDING, FULL = "sliding_attention", "full_attention"


def windows(raw: dict) -> dict:
    """ModelConfig's layer_windows, or {} where no layer's window is shorter than the context."""
    window = raw.get("sliding_window") if raw.get("use_sliding_window") else None
    layers = int(raw["num_hidden_layers"])
    if window is None or int(window) >= int(raw.get("max_position_embeddings", 2048)):
        return {}
    types = raw.get("layer_types") or [SLIDING if i >= int(raw.get("max_window_layers", 28)) else FULL
                                       for i in range(layers)]
    unknown = sorted(set(types) - {SLIDING, FULL})
    if unknown or len(types) != layers:
        raise ModelError(f"qwen2: layer_types {unknown[:1] or len(types)} is not supported "
                         f"(known: {SLIDING}, {FULL}, one a layer)")
    found = tuple(int(window) if t == SLIDING else 0 for t in types)
    return dict(layer_windows=found) if any(found) else {}


FAMILY = Family(
    name="qwen2",
    architectures=("Qwen2ForCausalLM",),
    qkv_bias=lambda raw: True,
    qk_norm=False,
    extras=windows,
    reads=frozenset({"sliding_window", "use_sliding_window", "layer_types"}),
)
