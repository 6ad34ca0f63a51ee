"""Qwen3 family: RMS norms on queries and keys per head, no projection biases by default."""

from .family import Family

FAMILY = Family(
    name="qwen3",
    architectures=("Qwen3ForCausalLM",),
    qkv_bias=lambda raw: bool(raw.get("attention_bias", False)),
    qk_norm=True,
)
