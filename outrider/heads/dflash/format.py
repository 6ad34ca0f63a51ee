"""The DFlash head on disk: z-lab's layout, which z-lab's DFlash, vLLM and SGLang load.

A folder with `config.json` (a Qwen3-style config: architectures ["DFlashDraftModel"],
num_hidden_layers L, hidden_size H, num_attention_heads, num_key_value_heads, head_dim,
intermediate_size, rms_norm_eps, rope_theta, vocab_size V, num_target_layers N, block_size B,
dflash_config {mask_token_id, target_layer_ids}) and `model.safetensors` (never pickles):

    fc.weight                                             [H, n*Ht]   n = len(target_layer_ids)
    hidden_norm.weight, norm.weight                       [H]
    layers.{l}.input_layernorm.weight                     [H]
    layers.{l}.self_attn.{q,k,v,o}_proj.weight            [nh*d, H] / [nkv*d, H] x2 / [H, nh*d]
    layers.{l}.self_attn.{q,k}_norm.weight                [d]
    layers.{l}.post_attention_layernorm.weight            [H]
    layers.{l}.mlp.{gate,up}_proj.weight / down_proj      [I, H] / [H, I]
    lm_head.weight, d2t int64, t2d bool (reduced vocab)   [Vd, H], [Vd], [V]: target id = d + d2t[d]

Layer ids follow DFlash's convention: id l is the output of target layer l (0-based), Hugging
Face's hidden_states[l + 1]; without ids a head reads `default_layer_ids(N, L)`. The head shares
the target's embedding (its MASK row included) and, without a reduced vocabulary, its lm_head.

What each loads (read at z-lab/dflash@44947fb `dflash/model.py`; vLLM `qwen3_dflash.py` and
SGLang `models/dflash.py` through the file index):

    zlab    DFlashDraftModel (a Qwen3PreTrainedModel: `AutoModel.from_pretrained(DIR,
            trust_remote_code=True)` with z-lab's dflash/model.py copied beside the config as
            dflash.py; we do not ship their code). fc is [H, n*H]: Ht must be H. No lm_head: it
            reads out through the target's, so a reduced vocabulary cannot be written.
    sglang  `--speculative-algorithm DFLASH --speculative-draft-model-path DIR`: layers.*, fc,
            hidden_norm, norm; fc [H, n*H] (Ht = H); it silently ignores any other tensor, so a
            reduced vocabulary (lm_head, d2t) is refused here too.
    vllm    `{"method": "dflash", "model": DIR, "num_speculative_tokens": B-1}`
            (DFlashQwen3ForCausalLM): reads top-level `eagle_aux_hidden_state_layer_ids` first
            (vllm semantics: DFlash id + 1; older images read nothing else), else
            dflash_config.target_layer_ids + 1; `target_hidden_size`; lm_head + d2t for a reduced
            `draft_vocab_size` (t2d ignored), else the target's lm_head.

All three read the same tensor names; an export writes config fields for all of them, the
`vllm` one adds the eagle_aux ids and the reduced vocabulary. Import is loading any of them
(`load_dflash`). Every problem is a one-line ModelError naming the folder and saying what to do.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ...errors import ModelError
from .head import DFlashConfig, DFlashHead, DFlashLayer, DFlashWeights
from ..vocab_map import draft_to_target
from ..files import open_weights, read_raw, read_weight

WEIGHTS = "model.safetensors"
FORMATS = ("zlab", "vllm", "sglang")
WHAT = "a DFlash head"


def is_dflash(raw: dict) -> bool:
    """Does this config.json describe a DFlash head (an architecture naming DFlash, or dflash_config)?"""
    return "dflash_config" in raw or any("dflash" in str(a).lower() for a in raw.get("architectures") or [])


def read_config(folder: str | Path) -> DFlashConfig:
    """The head's config.json, checked field by field (no weights read), in any of the layouts."""
    path = Path(folder) / "config.json"
    raw = read_raw(folder, what=WHAT)
    if not is_dflash(raw):
        raise ModelError(f"{path}: architectures {raw.get('architectures')} name no DFlash head (expected "
                         "DFlashDraftModel with a dflash_config); point it at a DFlash head folder")
    extra = raw.get("dflash_config")
    if not isinstance(extra, dict) or type(extra.get("mask_token_id")) is not int:
        raise ModelError(f"{path}: dflash_config.mask_token_id (an integer token id) is missing; "
                         "add it (the target token whose embedding fills the masked slots) or re-export the head")
    try:
        hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
        vocab = int(raw["vocab_size"])
        draft = raw.get("draft_vocab_size")
        rope = raw.get("rope_parameters") or {}
        return DFlashConfig(
            hidden_size=hidden, target_hidden_size=int(raw.get("target_hidden_size") or hidden), vocab_size=vocab,
            num_layers=int(raw["num_hidden_layers"]), num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads), intermediate_size=int(raw["intermediate_size"]),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_theta", rope.get("rope_theta", 1000000.0))),
            block_size=int(raw.get("block_size", extra.get("block_size", 16))),
            mask_token_id=int(extra["mask_token_id"]), target_layer_ids=_layer_ids(raw, extra, path),
            draft_vocab_size=None if draft is None or int(draft) == vocab else int(draft),
            num_target_layers=int(raw["num_target_layers"]) if raw.get("num_target_layers") is not None else None)
    except KeyError as missing:
        raise ModelError(f"{path}: missing field {missing}; is this a DFlash head's config.json?") from None
    except (TypeError, ValueError) as err:
        raise ModelError(f"{path}: a field has the wrong type ({err}); re-export the head") from None


def _layer_ids(raw: dict, extra: dict, path: Path) -> tuple[int, ...] | None:
    """dflash_config.target_layer_ids (DFlash's convention), else the top-level
    eagle_aux_hidden_state_layer_ids less one (vLLM's); the two must agree when both are there."""
    ids, aux = extra.get("target_layer_ids"), raw.get("eagle_aux_hidden_state_layer_ids")
    for name, value in (("dflash_config.target_layer_ids", ids), ("eagle_aux_hidden_state_layer_ids", aux)):
        if value is not None and (not isinstance(value, list) or not value or not all(type(i) is int for i in value)):
            raise ModelError(f"{path}: {name} must be a non-empty list of integers, got {value!r}")
    if ids is not None and aux is not None and [i + 1 for i in ids] != aux:
        raise ModelError(f"{path}: dflash_config.target_layer_ids {ids} and eagle_aux_hidden_state_layer_ids {aux} "
                         "name different target layers (the second must be the first plus one); re-export the head")
    if ids is not None:
        return tuple(ids)
    return tuple(i - 1 for i in aux) if aux is not None else None


def misfit(config: DFlashConfig, target_config) -> str | None:
    """Why a head with `config` cannot draft for this target (sizes, vocabulary, layers, mask id), or None."""
    c, t = config, target_config
    if c.target_hidden_size != t.hidden_size:
        return (f"the head reads target hidden states of size {c.target_hidden_size}, this target's are "
                f"{t.hidden_size}: it was made for another model; use a head trained for this target")
    if c.hidden_size != t.hidden_size:
        return (f"the head's hidden size {c.hidden_size} differs from the target's {t.hidden_size}, so it cannot "
                "share the target's embedding; use a head trained for this target")
    if c.vocab_size != t.vocab_size:
        return (f"the head's vocabulary has {c.vocab_size} tokens, the target's {t.vocab_size}: "
                "it was made for another model; use a head trained for this target")
    if c.draft_vocab_size is not None and not 1 <= c.draft_vocab_size <= c.vocab_size:
        return f"draft_vocab_size {c.draft_vocab_size} must be between 1 and vocab_size {c.vocab_size}"
    if not 0 <= c.mask_token_id < t.vocab_size:
        return (f"its mask_token_id {c.mask_token_id} is outside the target's vocabulary (0..{t.vocab_size - 1}); "
                "set dflash_config.mask_token_id to a token of this target")
    if c.block_size < 2:
        return f"block_size {c.block_size} must be at least 2 (the root and one masked slot)"
    if c.num_target_layers is not None and c.num_target_layers != t.num_layers:
        return (f"it was made for a target with {c.num_target_layers} layers, this one has {t.num_layers}; "
                "use a head made for this target")
    ids = c.layer_ids(t.num_layers)
    if any(not 0 <= i < t.num_layers for i in ids):
        return (f"its target_layer_ids {list(ids)} (DFlash's convention: the output of layer l, 0-based) are not "
                f"all layers of this target (0..{t.num_layers - 1}); use a head made for this target")
    return None


def expected_shapes(c: DFlashConfig, num_target_layers: int) -> tuple[dict, dict]:
    """(required, optional): tensor name -> shape that config `c` implies for a target of
    `num_target_layers` layers; lm_head, d2t and t2d are required for a reduced vocabulary."""
    H, D, I = c.hidden_size, c.head_dim, c.intermediate_size
    n = len(c.layer_ids(num_target_layers))
    required = {"fc.weight": (H, n * c.target_hidden_size), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for l in range(c.num_layers):
        p = f"layers.{l}."
        required.update({
            p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (c.num_heads * D, H), p + "self_attn.k_proj.weight": (c.num_kv_heads * D, H),
            p + "self_attn.v_proj.weight": (c.num_kv_heads * D, H), p + "self_attn.o_proj.weight": (H, c.num_heads * D),
            p + "self_attn.q_norm.weight": (D,), p + "self_attn.k_norm.weight": (D,),
            p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H), p + "mlp.down_proj.weight": (H, I)})
    Vd = c.draft_vocab_size or c.vocab_size
    optional = {"lm_head.weight": (Vd, H)}
    if Vd < c.vocab_size:
        required.update({"lm_head.weight": (Vd, H), "d2t": (Vd,), "t2d": (c.vocab_size,)})
    return required, optional


def read_tensors(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the head's model.safetensors exactly as stored, on the CPU."""
    folder = Path(folder)
    tensors = open_weights(folder, what=WHAT)
    return {n: read_weight(tensors, folder, n) for n in tensors.keys()}


def load_dflash(folder: str | Path, target) -> DFlashHead:
    """Load the head in `folder` to draft for `target` (a Decoder): its weights on the target's
    device and dtype; the target's embedding and (without a reduced vocabulary) lm_head shared."""
    folder = Path(folder)
    config = read_config(folder)
    reason = misfit(config, target.config)
    if reason:
        raise ModelError(f"DFlash head {folder}: {reason}")
    tensors = open_weights(folder, what=WHAT)
    names = set(tensors.keys())
    required, optional = expected_shapes(config, target.config.num_layers)
    missing = [n for n in required if n not in names]
    if missing:
        raise ModelError(f"DFlash head {folder}: {WEIGHTS} lacks tensor(s) {', '.join(missing)}; "
                         "the export is incomplete: re-export the head")
    for name, shape in {**required, **{n: s for n, s in optional.items() if n in names}}.items():
        got = tuple(tensors.get_slice(name).get_shape())
        if got != shape:
            raise ModelError(f"DFlash head {folder}: tensor {name} has shape {list(got)} but its config.json says "
                             f"{list(shape)}; the config and the weights disagree: re-export the head")
    stored = {n: read_weight(tensors, folder, n) for n in names if n in required or n in optional}
    return DFlashHead(config, runtime_weights(stored, config, target, where=str(folder)))


def runtime_weights(tensors: dict[str, torch.Tensor], config: DFlashConfig, target, where: str = "the head",
                    device=None, dtype=None) -> DFlashWeights:
    """DFlashWeights from tensors under z-lab's names, on `target`'s device and dtype (or the
    given ones), sharing `target`'s embedding and (without its own lm_head) its lm_head. `target`
    is a Decoder, or anything with `embed`, `lm_head`, `device` and `dtype`."""
    device = device if device is not None else target.device
    dtype = dtype if dtype is not None else target.dtype
    get = lambda name: tensors[name].to(device=device, dtype=dtype)  # noqa: E731
    layers = []
    for l in range(config.num_layers):
        p, a, m = f"layers.{l}.", f"layers.{l}.self_attn.", f"layers.{l}.mlp."
        layers.append(DFlashLayer(
            input_norm=get(p + "input_layernorm.weight"), q=get(a + "q_proj.weight"), k=get(a + "k_proj.weight"),
            v=get(a + "v_proj.weight"), q_norm=get(a + "q_norm.weight"), k_norm=get(a + "k_norm.weight"),
            o=get(a + "o_proj.weight"), post_norm=get(p + "post_attention_layernorm.weight"),
            gate_up=torch.cat([get(m + "gate_proj.weight"), get(m + "up_proj.weight")]), down=get(m + "down_proj.weight")))
    d2t = None
    if "d2t" in tensors:
        d2t = draft_to_target(tensors["d2t"], tensors["t2d"], where).to(device)
    own = "lm_head.weight" in tensors
    return DFlashWeights(fc=get("fc.weight"), hidden_norm=get("hidden_norm.weight"), layers=layers,
                         norm=get("norm.weight"), lm_head=get("lm_head.weight") if own else target.lm_head,
                         embed=target.embed, draft_to_target=d2t)


def config_json(c: DFlashConfig, fmt: str, *, dtype: str, num_target_layers: int | None = None,
                max_positions: int = 32768) -> dict:
    """config.json of layout `fmt` (FORMATS; the module docstring says what each reads)."""
    n_layers = num_target_layers or c.num_target_layers
    if n_layers is None:
        raise ModelError("the head records no num_target_layers: pass the target to export it")
    ids = list(c.layer_ids(n_layers))
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},  # z-lab's remote code, placed beside as dflash.py
        "num_hidden_layers": c.num_layers, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "hidden_act": "silu", "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        "max_position_embeddings": max_positions, "attention_bias": False, "attention_dropout": 0.0,
        "tie_word_embeddings": False, "vocab_size": c.vocab_size, "num_target_layers": n_layers,
        "block_size": c.block_size, "torch_dtype": dtype,
        "dflash_config": {"mask_token_id": c.mask_token_id, "target_layer_ids": ids},
    }
    if fmt == "vllm":
        config["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in ids]
        config["target_hidden_size"] = c.target_hidden_size
    if c.draft_vocab_size is not None:  # a reduced vocabulary (only the vllm layout loads it)
        config["draft_vocab_size"] = c.draft_vocab_size
    return config
