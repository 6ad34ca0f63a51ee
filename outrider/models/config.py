"""The model configuration the runtime needs, read from a Hugging Face `config.json`.

Only what changes the arithmetic is kept. Families differ by a few switches (biases on the
Q/K/V projections, RMS norms on queries and keys, tied embeddings); `families.py` maps an
architecture name to those switches and refuses the rest with a clear message; a field that would
change the arithmetic and is not read (RoPE scaling, sliding windows, soft-capping, ...) is refused
too (`config_fields.py`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import ModelError
from .config_fields import partial_rotary, refusal
from .families import family_for
from .family import ATTENTION, DENSE, GATED_DELTA, LATENT, MOE
from .mla_config import MlaConfig
from .moe_config import MoeConfig
from .rope import RopeSpec, exact_context


@dataclass(frozen=True)
class DeltaConfig:
    """A gated-delta (linear attention) layer's sizes: its key heads share queries and keys across
    num_v_heads / num_k_heads value heads; a short causal convolution of `conv_kernel` taps."""

    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int
    grouped: bool = False  # its in_proj on disk grouped per key head (Qwen3-Next; family.delta_grouped)

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: queries, keys and values together."""
        return 2 * self.num_k_heads * self.k_head_dim + self.num_v_heads * self.v_head_dim


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
    qk_norm_whole: bool = False  # the q/k norms over the whole projection, not per head (OLMoE's)
    layer_kinds: tuple[str, ...] = ()  # each layer's mixer (family.ATTENTION, GATED_DELTA); () : attention
    rotary_dim: int = 0  # dimensions of a head that rotate (partial rotary); 0: all of head_dim
    attn_output_gate: bool = False  # attention output times sigmoid(gate): q_proj's second half
    # Gemma 3's (models/gemma3.py): each layer's sliding window (0: the whole context; (): none), the
    # RoPE of the sliding-window layers, the attention scale (0: head_dim ** -0.5), norms on the
    # attention's and the MLP's outputs, embeddings times sqrt(hidden_size), the gated MLP's activation
    layer_windows: tuple[int, ...] = ()
    rope_local: RopeSpec | None = None
    attn_scale: float = 0.0
    sandwich_norms: bool = False
    embed_scale: bool = False
    activation: str = "silu"  # "silu" (SwiGLU) or "gelu_tanh" (GELU with tanh, gated)
    norm_plus_one: bool = False  # norms scale by 1 + weight (folded into the weights at load)
    delta: DeltaConfig | None = None  # the gated-delta layers' sizes (hybrids)
    rope: RopeSpec = RopeSpec()  # the rotary embedding's type and parameters (models/rope.py)
    mlp_kinds: tuple[str, ...] = ()  # each layer's MLP (family.DENSE, MOE); (): dense everywhere
    moe: MoeConfig | None = None  # the sparse MLPs' router and sizes (moe_config.py)
    # latent attention's sizes (mla_config.py; its layers keep a LatentCache: num_kv_heads 1, the
    # shared latent row; head_dim dn + dr, rotary_dim dr), and MiniCPM3's scalings: embeddings times
    # embed_multiplier, each residual branch times residual_scale, the final norm's output divided by
    # logit_divisor before the head
    mla: MlaConfig | None = None
    embed_multiplier: float = 1.0
    residual_scale: float = 1.0
    logit_divisor: float = 1.0
    # a vision-language model's vision tower (models/vision_encoder.py VisionConfig): the fields above
    # are its text model's, which the decoder runs; None for a text model
    vision: object | None = None

    def kind(self, layer: int) -> str:
        return self.layer_kinds[layer] if self.layer_kinds else ATTENTION

    def mlp_kind(self, layer: int) -> str:
        return self.mlp_kinds[layer] if self.mlp_kinds else DENSE

    @property
    def attention_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.kind(i) == ATTENTION]

    @property
    def rotary(self) -> int:
        return self.rotary_dim or self.head_dim

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window: a query at position p sees keys at positions > p - window;
        0: every earlier position."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def plain_block(self) -> bool:
        """No Gemma-style extras (windows, a local RoPE, another scale, sandwich norms, scaled
        embeddings, another activation): the block kernels/decoder_layer.c runs."""
        return not (self.layer_windows or self.rope_local or self.attn_scale or self.sandwich_norms
                    or self.embed_scale or self.activation != "silu" or self.embed_multiplier != 1.0
                    or self.residual_scale != 1.0 or self.logit_divisor != 1.0)

    @staticmethod
    def from_dict(raw: dict, source: str = "config.json") -> "ModelConfig":
        archs = raw.get("architectures") or [raw.get("model_type", "?")]
        family = family_for(archs[0], source)
        if family.text_config is not None:  # a vision-language model: its text model, and its vision tower
            text = ModelConfig.from_dict(family.text_config(raw), source)
            return replace(text, architecture=archs[0], vision=family.vision(raw))
        why = refusal(raw, family)  # a field that would change the arithmetic, set: never run it wrong
        if why:
            raise ModelError(f"{source}: {why}; this model would not compute what it was trained to "
                             "(docs/models.md lists what runs)")
        params = raw.get("rope_parameters") or {}
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            config = ModelConfig(
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
                # longrope's long factors are not taken: the context ends where its short ones do (models/rope.py)
                max_position_embeddings=exact_context(RopeSpec.of(raw), int(raw.get("max_position_embeddings", 2048))),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                qkv_bias=family.qkv_bias(raw),
                qk_norm=family.qk_norm,
                qk_norm_whole=family.qk_norm and family.qk_norm_whole,
                rope=RopeSpec.of(raw),
                **_kinds(raw, family, int(raw.get("head_dim") or hidden // heads)),
                **family.extras(raw),
            )
            if config.mla is not None:  # one latent row a token, shared by every head
                config = replace(config, num_kv_heads=1, head_dim=config.mla.qk_dim)
            return config
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


def _kinds(raw: dict, family, head_dim: int) -> dict:
    """The fields of a family beyond one Llama block: layer kinds, partial rotary, the output
    gate, (1 + w) norms, a hybrid's gated-delta sizes, and MLP kinds with the experts' sizes."""
    kinds = family.layer_kinds(raw)
    if len(kinds) != int(raw["num_hidden_layers"]):
        raise ModelError(f"layer_types names {len(kinds)} layers, num_hidden_layers is {raw['num_hidden_layers']}")
    rotary = int(head_dim * partial_rotary(raw)) if "partial_rotary_factor" in family.reads else 0
    mla = family.mla(raw) if LATENT in kinds else None
    if mla is not None:
        rotary = mla.rope_dim
    delta = None
    if GATED_DELTA in kinds:
        delta = DeltaConfig(int(raw["linear_num_key_heads"]), int(raw["linear_num_value_heads"]),
                            int(raw["linear_key_head_dim"]), int(raw["linear_value_head_dim"]),
                            int(raw["linear_conv_kernel_dim"]), family.delta_grouped)
        if delta.num_v_heads % delta.num_k_heads:
            raise ModelError(f"linear_num_value_heads {delta.num_v_heads} is not a multiple of "
                             f"linear_num_key_heads {delta.num_k_heads}")
    mlps = family.mlp_kinds(raw)
    if len(mlps) != len(kinds):
        raise ModelError(f"{family.name} names {len(mlps)} MLPs for {len(kinds)} layers")
    return dict(layer_kinds=() if set(kinds) == {ATTENTION} else tuple(kinds), rotary_dim=rotary,
                attn_output_gate=family.attn_output_gate, norm_plus_one=family.norm_plus_one, delta=delta,
                mlp_kinds=() if set(mlps) == {DENSE} else tuple(mlps), moe=family.moe(raw) if MOE in mlps else None,
                mla=mla)
