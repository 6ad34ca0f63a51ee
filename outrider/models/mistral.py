"""Mistral family (Mistral 7B v0.1 to v0.3, Mistral-Nemo): the Llama block under another name, and
a sliding window on every layer where its config sets one.

Its configs carry `sliding_window`: where it is null (v0.2, v0.3, Nemo) every layer attends to the
whole context and the arithmetic is Llama's; where it is shorter than the context (v0.1's 4096),
a query at position p sees keys at positions > p - sliding_window on every layer, as transformers'
Mistral does (models/sliding.py: masks by position, exact under speculation; the rows that leave
the window are freed: each layer keeps a ring of the window, models/ring_cache.py). A window as
long as the context or longer never cuts a key the engine can reach (it stops at max_position_embeddings): no window then, and the
block kernels run. `layer_types` (Ministral's alternating layers) is refused
(models/config_fields.py).
"""

from .family import Family


def windows(raw: dict) -> dict:
    """ModelConfig's layer_windows: `sliding_window` on every layer when shorter than the context."""
    window = raw.get("sliding_window")
    if window is None or int(window) >= int(raw.get("max_position_embeddings", 2048)):
        return {}
    return dict(layer_windows=(int(window),) * int(raw["num_hidden_layers"]))


FAMILY = Family(
    name="mistral",
    architectures=("MistralForCausalLM",),
    qkv_bias=lambda raw: False,
    qk_norm=False,
    extras=windows,
    reads=frozenset({"sliding_window"}),
)
