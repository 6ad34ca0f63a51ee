"""Gemma 3 (text: `Gemma3ForCausalLM`, the 270M to 27B text decoders).

Its block beside Llama's, each read from its config.json here or in models/config.py:

- RMS norms that scale by (1 + weight), on queries and keys per head too (`norm_plus_one`,
  `qk_norm`; folded into the weights at load);
- a norm on the attention's output and on the MLP's output before each joins the residual (the
  sandwich: `post_attention_layernorm`, `post_feedforward_layernorm`; the MLP's input norm is
  `pre_feedforward_layernorm`), models/sandwich_layer.py;
- embeddings times sqrt(hidden_size), in the embedding's dtype as transformers rounds it;
- a GELU (tanh approximation) gated MLP (`hidden_activation: gelu_pytorch_tanh`);
- head_dim of its own (256), attention scores scaled by query_pre_attn_scalar ** -0.5;
- sliding-window layers interleaved with global ones (`layer_types`, or every
  `sliding_window_pattern`-th layer global when absent): a query at position p sees keys at
  positions > p - sliding_window (models/sliding.py), and those layers rotate with their own RoPE
  base (`rope_parameters["sliding_attention"]` as transformers 5 writes it, `rope_local_base_freq`
  before it; 10,000 by default), the global layers with the model's (1,000,000 by default).

Logit soft-capping (`final_logit_softcapping`, `attn_logit_softcapping`: null in Gemma 3's
configs) and bidirectional attention are refused in one line (models/config_fields.py).
"""

from __future__ import annotations

from ..errors import ModelError
from .family import Family
from .rope import RopeSpec, by_layer_type

SLIDING, FULL = "sliding_attention", "full_attention"
ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")  # GELU's tanh approximation, by transformers' names


def layer_types(raw: dict) -> list[str]:
    """Each layer's type: `layer_types`, else every `sliding_window_pattern`-th layer global."""
    layers = int(raw["num_hidden_layers"])
    types = raw.get("layer_types")
    if types is None:
        pattern = int(raw.get("sliding_window_pattern", raw.get("_sliding_window_pattern", 6)))
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
    unknown = sorted(set(types) - {SLIDING, FULL})
    if unknown:
        raise ModelError(f"layer type {unknown[0]!r} is not supported for gemma3 (known: {SLIDING}, {FULL})")
    return list(types)


def _fields(raw: dict) -> dict:
    """ModelConfig's Gemma 3 fields (models/config.py ModelConfig.from_dict)."""
    types = layer_types(raw)
    window = raw.get("sliding_window")
    if SLIDING in types and not window:
        raise ModelError("gemma3: sliding_attention layers but no sliding_window")
    activation = raw.get("hidden_activation") or "gelu_pytorch_tanh"
    if activation not in ACTIVATIONS:
        raise ModelError(f"an MLP activation other than GELU-tanh (hidden_activation: {activation}) is not "
                         "supported yet for gemma3")
    if by_layer_type(raw.get("rope_parameters")):
        local = RopeSpec.of(raw, SLIDING)
    else:  # transformers 4's form: rope_theta and rope_scaling are the global layers'
        local = RopeSpec("default", float(raw.get("rope_local_base_freq") or 10000.0))
    return dict(layer_windows=tuple(int(window) if t == SLIDING else 0 for t in types), rope_local=local,
                attn_scale=float(raw.get("query_pre_attn_scalar") or 256) ** -0.5, sandwich_norms=True,
                embed_scale=True, activation="gelu_tanh")


FAMILY = Family(
    name="gemma3",
    architectures=("Gemma3ForCausalLM",),
    qkv_bias=lambda raw: False,
    qk_norm=True,
    norm_plus_one=True,
    extras=_fields,
    reads=frozenset({"layer_types", "sliding_window", "rope_parameters", "hidden_activation", "query_pre_attn_scalar",
                     "rope_local_base_freq"}),
)
