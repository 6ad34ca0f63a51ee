"""Idefics3 and SmolVLM (`Idefics3ForConditionalGeneration`, `SmolVLMForConditionalGeneration`): a
vision-language model, a SigLIP-style vision encoder and a pixel-shuffle connector
(models/vision_encoder.py) in front of a Llama text model.

The text model is the runtime's decoder, read from `text_config` under the Llama family's switches
and checks (its tensors under `model.text_model.`: weights/vision_load.py), so every drafter,
tree and controller runs on it unchanged; its positions are the text's own (1-D, one a token,
image tokens included). The image side runs once a prompt: each image becomes K rows that replace
the embeddings of its K `<image>` tokens (models/image_prompt.py). What is not supported (image
splitting, images other than one S x S tile, a text model other than Llama) is in docs/models.md.
"""

from __future__ import annotations

from ..errors import ModelError
from .family import Family
from .vision_encoder import VisionConfig

TEXT_FAMILIES = {"llama": "LlamaForCausalLM"}  # text_config's model_type -> the family that runs it


def text_config(raw: dict) -> dict:
    """The text model's config.json fields, named for its own family (Llama); the top level's
    tie_word_embeddings where it gives one (transformers ties lm_head by the top level's)."""
    text = dict(raw.get("text_config") or {})
    kind = text.get("model_type", "llama")
    if kind not in TEXT_FAMILIES:
        raise ModelError(f"a {raw.get('model_type', 'idefics3')} text model of type {kind!r} is not supported yet "
                         f"(supported: {', '.join(TEXT_FAMILIES)})")
    text["architectures"] = [TEXT_FAMILIES[kind]]
    if "tie_word_embeddings" in raw:
        text["tie_word_embeddings"] = raw["tie_word_embeddings"]
    return text


def vision_config(raw: dict) -> VisionConfig:
    v = raw.get("vision_config") or {}
    act = v.get("hidden_act", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ModelError(f"a vision encoder activation other than GELU-tanh (hidden_act: {act}) is not supported yet")
    try:
        config = VisionConfig(
            hidden_size=int(v["hidden_size"]), intermediate_size=int(v["intermediate_size"]),
            num_layers=int(v["num_hidden_layers"]), num_heads=int(v["num_attention_heads"]),
            image_size=int(v["image_size"]), patch_size=int(v["patch_size"]),
            num_channels=int(v.get("num_channels", 3)), layer_norm_eps=float(v.get("layer_norm_eps", 1e-6)),
            scale_factor=int(raw.get("scale_factor", 2)), image_token_id=int(raw["image_token_id"]),
            text_hidden_size=int(raw["text_config"]["hidden_size"]))
    except KeyError as missing:
        raise ModelError(f"vision_config: missing field {missing}") from None
    side = config.patches_per_side
    if config.image_size % config.patch_size or side % config.scale_factor:
        raise ModelError(f"vision_config: image_size {config.image_size} is not a whole number of patches of "
                         f"{config.patch_size} in blocks of scale_factor {config.scale_factor}")
    return config


FAMILY = Family(
    name="idefics3",
    architectures=("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration"),
    qkv_bias=lambda raw: False,
    qk_norm=False,
    text_config=text_config,
    vision=vision_config,
)
