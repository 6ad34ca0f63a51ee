"""Outrider's Llama hybrid: a Llama decoder (SmolLM2) whose attention layers are, but for a few,
replaced by gated-delta mixers (models/delta_layer.py) distilled from them
(train/distill_hybrid.py; the shipped one: docs/models.md, `smollm2-135m-gdn`).

Its config.json is the Llama one plus `layer_types` ("full_attention" / "linear_attention", one per
layer) and the gated-delta sizes (`linear_*`, Qwen3.5's names); the architecture name is Outrider's
own (`OutriderLlamaHybridForCausalLM`): transformers has no such class and cannot load it. Attention
layers are Llama's (no q/k norms, no output gate, plain RMS norms); gated-delta layers keep their
weights under Qwen3.5's names (`linear_attn.in_proj_qkv`, ...; weights/loader.py `_delta_layer`).
"""

from .family import Family
from .qwen3_5 import layer_kinds

ARCHITECTURE = "OutriderLlamaHybridForCausalLM"

FAMILY = Family(
    name="llama_hybrid",
    architectures=(ARCHITECTURE,),
    qkv_bias=lambda raw: False,
    qk_norm=False,
    layer_kinds=layer_kinds,
    reads=frozenset({"layer_types"}),
)
