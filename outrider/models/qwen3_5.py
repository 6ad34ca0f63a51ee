"""Qwen3.5 (text): a hybrid of gated-delta layers and, every few layers, gated attention.

From its config.json: `layer_types` ("linear_attention" / "full_attention"; by default three
gated-delta layers then one attention layer), the gated-delta sizes (`linear_*`), attention with
RMS-normed queries and keys, an output gate (q_proj's rows hold each head's queries then its
gate), partial rotary embeddings (`rope_parameters.partial_rotary_factor`, a quarter of each head)
and norms that scale by (1 + weight).
"""

from .family import ATTENTION, GATED_DELTA, Family

KINDS = {"full_attention": ATTENTION, "linear_attention": GATED_DELTA}


def _kinds(raw: dict) -> tuple[str, ...]:
    layers = int(raw["num_hidden_layers"])
    types = raw.get("layer_types") or [
        "full_attention" if (i + 1) % int(raw.get("full_attention_interval", 4)) == 0 else "linear_attention"
        for i in range(layers)]
    unknown = sorted(set(types) - set(KINDS))
    if unknown:
        from ..errors import ModelError

        raise ModelError(f"layer type {unknown[0]!r} is not supported (known: {', '.join(KINDS)})")
    return tuple(KINDS[t] for t in types)


layer_kinds = _kinds  # each layer's mixer kind; Qwen3-Next's are laid out the same way (qwen3_next.py)


FAMILY = Family(
    name="qwen3_5",
    architectures=("Qwen3_5ForCausalLM", "Qwen3_5TextForCausalLM"),
    qkv_bias=lambda raw: False,
    qk_norm=True,
    layer_kinds=_kinds,
    attn_output_gate=True,
    norm_plus_one=True,
    reads=frozenset({"layer_types", "partial_rotary_factor", "rope_parameters"}),
)
