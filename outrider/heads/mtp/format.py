"""The MTP head on disk: DeepSeek-V3's layout, the module stored as the target's layer N.

A folder with `config.json` (the target's Llama config fields: hidden_size, intermediate_size,
num_attention_heads, num_key_value_heads, head_dim, vocab_size, rms_norm_eps, rope_theta,
num_hidden_layers N, plus `num_nextn_predict_layers: 1`, which says the checkpoint carries an
MTP module, and `mtp_hidden: "pre_norm"`, the hidden it reads) and `model.safetensors`:

    model.layers.{N}.enorm.weight, hnorm.weight                      [H]
    model.layers.{N}.eh_proj.weight                                  [H, 2H]  (embedding columns first)
    model.layers.{N}.shared_head.norm.weight                         [H]
    model.layers.{N}.input_layernorm.weight, post_attention_layernorm.weight   [H]
    model.layers.{N}.self_attn.{q,k,v,o}_proj.weight                 [nh*d, H] / [nkv*d, H] x2 / [H, nh*d]
    model.layers.{N}.mlp.{gate,up,down}_proj.weight                  [I, H] x2 / [H, I]
    model.layers.{N}.embed_tokens.weight, shared_head.head.weight    [V, H]   only in a `vllm` export

These are the names vLLM's `deepseek_mtp.py` loads (DeepSeekMultiTokenPredictorLayer: enorm, hnorm,
eh_proj, shared_head.{norm,head}, the decoder layer's own names under mtp_block; embed_tokens
rewritten to the model's; read at vllm-project/vllm 03356f8 through the file index). A shipped
head leaves out the two [V, H] tensors (they are the target's: 2 x 113 MB for SmolLM2) and shares
the target's; `outrider export mtp --format vllm` writes them (export.py). What loads it and what
does not is written in export.py.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ...errors import ModelError
from ..files import open_weights, read_raw, read_weight
from .head import MtpConfig, MtpHead, MtpWeights

WEIGHTS = "model.safetensors"
WHAT = "an MTP head"
SHARED = ("embed_tokens.weight", "shared_head.head.weight")  # [V, H] each: the target's, in a vllm export


def is_mtp(raw: dict) -> bool:
    """Does this config.json describe an MTP head (num_nextn_predict_layers > 0)?"""
    layers = raw.get("num_nextn_predict_layers")
    return isinstance(layers, int) and not isinstance(layers, bool) and layers > 0


def tensor_names(n: int) -> tuple[str, ...]:
    """The module's own tensors, in MtpTrainable._ATTRS' order, stored as layer `n`."""
    p = f"model.layers.{n}."
    return tuple(p + name for name in (
        "enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "input_layernorm.weight",
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
        "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"))


def expected_shapes(c: MtpConfig) -> tuple[dict, dict]:
    """(required, optional): tensor name -> shape."""
    H, D, I, V = c.hidden_size, c.head_dim, c.intermediate_size, c.vocab_size
    shapes = ((H,), (H,), (H, 2 * H), (H,), (H,), (c.num_heads * D, H), (c.num_kv_heads * D, H),
              (c.num_kv_heads * D, H), (H, c.num_heads * D), (H,), (I, H), (I, H), (H, I))
    required = dict(zip(tensor_names(c.num_target_layers), shapes))
    optional = {f"model.layers.{c.num_target_layers}.{name}": (V, H) for name in SHARED}
    return required, optional


def read_config(folder: str | Path) -> MtpConfig:
    path = Path(folder) / "config.json"
    raw = read_raw(folder, what=WHAT)
    if not is_mtp(raw):
        raise ModelError(f"{path}: num_nextn_predict_layers is not a positive integer, so this is no MTP head; "
                         "point it at an MTP head folder")
    if raw["num_nextn_predict_layers"] != 1:
        raise ModelError(f"{path}: num_nextn_predict_layers {raw['num_nextn_predict_layers']}: only one MTP "
                         "module (reused for every draft step) is supported")
    if raw.get("mtp_hidden", "pre_norm") != "pre_norm":
        raise ModelError(f"{path}: mtp_hidden {raw.get('mtp_hidden')!r}: only \"pre_norm\" (the last layer's "
                         "output before the final norm) is supported")
    try:
        hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
        return MtpConfig(hidden_size=hidden, vocab_size=int(raw["vocab_size"]), num_heads=heads,
                         num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                         head_dim=int(raw.get("head_dim") or hidden // heads),
                         intermediate_size=int(raw["intermediate_size"]),
                         rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                         rope_theta=float(raw.get("rope_theta", 10000.0)),
                         num_target_layers=int(raw["num_hidden_layers"]))
    except KeyError as missing:
        raise ModelError(f"{path}: missing field {missing}; is this an MTP head's config.json?") from None
    except (TypeError, ValueError) as err:
        raise ModelError(f"{path}: a field has the wrong type ({err}); re-export the head") from None


def misfit(c: MtpConfig, t) -> str | None:
    """Why a head with config `c` cannot draft for a target with config `t`, or None."""
    if c.hidden_size != t.hidden_size:
        return (f"the head's hidden size {c.hidden_size} differs from the target's {t.hidden_size}: it was made "
                "for another model; use a head trained for this target")
    if c.vocab_size != t.vocab_size:
        return f"the head's vocabulary has {c.vocab_size} tokens, the target's {t.vocab_size}: made for another model"
    if c.num_target_layers != t.num_layers:
        return (f"it is stored as layer {c.num_target_layers} of a {c.num_target_layers}-layer target, this one "
                f"has {t.num_layers} layers; use a head made for this target")
    return None


def config_json(c: MtpConfig, dtype: str = "float32") -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": c.num_target_layers,
            "num_nextn_predict_layers": 1, "mtp_hidden": "pre_norm", "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_heads,
            "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "vocab_size": c.vocab_size,
            "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "hidden_act": "silu",
            "tie_word_embeddings": False, "torch_dtype": dtype}


def load_mtp(folder: str | Path, target) -> MtpHead:
    """The head in `folder` drafting for `target` (a Decoder): its weights float on the target's
    device and dtype (a quantized target's float dtype), the target's embedding and lm_head
    shared unless the folder carries its own (a vllm export)."""
    folder = Path(folder)
    c = read_config(folder)
    reason = misfit(c, target.config)
    if reason:
        raise ModelError(f"MTP head {folder}: {reason}")
    tensors = open_weights(folder, what=WHAT)
    names = set(tensors.keys())
    required, optional = expected_shapes(c)
    missing = [n for n in required if n not in names]
    if missing:
        raise ModelError(f"MTP head {folder}: {WEIGHTS} lacks tensor(s) {', '.join(missing)}; re-export the head")
    for name, shape in {**required, **{n: s for n, s in optional.items() if n in names}}.items():
        got = tuple(tensors.get_slice(name).get_shape())
        if got != shape:
            raise ModelError(f"MTP head {folder}: tensor {name} has shape {list(got)} but its config.json says "
                             f"{list(shape)}; re-export the head")
    get = lambda n: read_weight(tensors, folder, n).to(device=target.device, dtype=target.dtype)  # noqa: E731
    (enorm, hnorm, eh, norm, inorm, q, k, v, o, pnorm, gate, up, down) = (get(n) for n in required)
    p = f"model.layers.{c.num_target_layers}."
    return MtpHead(c, MtpWeights(
        enorm=enorm, hnorm=hnorm, eh_proj=eh, input_norm=inorm, qkv=torch.cat((q, k, v)), o=o, post_norm=pnorm,
        gate_up=torch.cat((gate, up)), down=down, norm=norm, lm_head=get(p + SHARED[1]) if p + SHARED[1] in names else target.lm_head,
        embed=get(p + SHARED[0]) if p + SHARED[0] in names else target.embed))
