"""Mistral family (Mistral 7B v0.2 and later, Mistral-Nemo): the Llama block under another name.

Its configs carry `sliding_window`; where it is null (v0.2, v0.3, Nemo) every layer attends to the
whole context and the arithmetic is Llama's. A window shorter than the context (Mistral 7B v0.1's
4096) is refused by models/config_fields.py until sliding windows are a layer option.
"""

from .family import Family

FAMILY = Family(
    name="mistral",
    architectures=("MistralForCausalLM",),
    qkv_bias=lambda raw: False,
    qk_norm=False,
)
