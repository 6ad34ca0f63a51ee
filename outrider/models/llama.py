"""Llama family (Llama 2/3, SmolLM2): no projection biases unless `attention_bias` says so."""

from .family import Family

FAMILY = Family(
    name="llama",
    architectures=("LlamaForCausalLM",),
    qkv_bias=lambda raw: bool(raw.get("attention_bias", False)),
    qk_norm=False,
)
