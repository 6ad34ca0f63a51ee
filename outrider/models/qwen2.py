"""Qwen2 family (Qwen2, Qwen2.5, Qwen2.5-Coder): biases on the Q, K and V projections."""

from .family import Family

FAMILY = Family(
    name="qwen2",
    architectures=("Qwen2ForCausalLM",),
    qkv_bias=lambda raw: True,
    qk_norm=False,
)
