"""A grouped-query model converted to latent attention the MHA2MLA way (`Mha2MlaForCausalLM`,
Outrider's own architecture name: scripts/convert_mla.py writes it; transformers does not load it).

DeepSeek-V2's tensor names and fields (latent_layer.py computes it) with what a linear conversion
of a Qwen2 / Llama attention needs beside them:
- `qk_rope_heads`: one rotated key per K/V head of the source (its kept RoPE dimensions), not
  one shared by every head; query head h reads rotated key h // (H / qk_rope_heads);
- `kv_latent_norm: false`: no kv_a_layernorm (the latent is a linear map of the input, as the
  joint SVD of the source's K and V gives it);
- biases where the source has them, read when present: q_proj.bias, kv_a_proj_with_mqa.bias
  (its rotated keys' share of the source's k bias; the rest of the k bias only adds a constant to
  every score of a query and drops out of the softmax), o_proj.bias (the v bias through o_proj:
  a value bias passes the softmax's weights, which sum to 1, unchanged);
- RoPE on halves (Llama's) at the source's rope_theta, on the kept frequencies' dimensions.
Everything else (the block, norms, MLP, head) is Qwen2's / Llama's.
"""

from .family import LATENT, Family
from .mla_config import deepseek_mla

FAMILY = Family(
    name="mha2mla",
    architectures=("Mha2MlaForCausalLM",),
    qkv_bias=lambda raw: False,
    qk_norm=False,
    layer_kinds=lambda raw: (LATENT,) * int(raw["num_hidden_layers"]),
    mla=lambda raw: deepseek_mla(raw, interleaved=False, converted=True),
)
