"""The model configuration the runtime needs, read from a Hugging Face `config.json`.

Only what changes the arithmetic is kept. Families differ by a few switches (biases on the
Q/K/V projections, RMS norms on queries and keys, tied embeddings); `families.py` maps an
architecture name to those switches and refuses the rest with a clear message; a field that would
change the arithmetic and is not read (RoPE scaling, sliding windows, soft-capping, ...) is refused
too (`config_fields.py`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelError
from .config_fields import refusal
from .families import family_for


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool

    @staticmethod
    def from_dict(raw: dict, source: str = "config.json") -> "ModelConfig":
        archs = raw.get("architectures") or [raw.get("model_type", "?")]
        family = family_for(archs[0], source)
        why = refusal(raw, family)  # a field that would change the arithmetic, set: never run it wrong
        if why:
            raise ModelError(f"{source}: {why}; this model would not compute what it was trained to "
                             "(docs/models.md lists what runs)")
        params = raw.get("rope_parameters") or {}
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            return ModelConfig(
                architecture=archs[0],
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(raw.get("rope_theta", params.get("rope_theta", 10000.0))),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                qkv_bias=family.qkv_bias(raw),
                qk_norm=family.qk_norm,
            )
        except KeyError as missing:
            raise ModelError(f"{source}: missing field {missing}; is this a causal LM config.json?") from None

    @staticmethod
    def load(folder: Path) -> "ModelConfig":
        path = Path(folder) / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ModelError(f"{path} not found: point at a Hugging Face model folder") from None
        except json.JSONDecodeError as err:
            raise ModelError(f"{path} is not valid JSON ({err.msg} at line {err.lineno}); re-pull the model") from None
        return ModelConfig.from_dict(raw, str(path))
