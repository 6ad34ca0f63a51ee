"""The DSpark head on disk: DeepSpec's `Qwen3DSparkModel` config with the speculators fields, and
z-lab's DFlash tensor names plus the Markov and confidence heads.

A folder with `config.json` and `model.safetensors` (never pickles). The config is a Qwen3-style
config with DeepSpec's DSpark fields (deepseek-ai/DeepSpec `deepspec/modeling/dspark/qwen3/config.py`
and `modeling.py`, read through the file index: architectures ["Qwen3DSparkModel"],
num_target_layers, num_hidden_layers, block_size, mask_token_id, target_layer_ids,
enable_confidence_head, confidence_head_with_markov, markov_rank, markov_head_type), the fields a
speculators-style loader reads (`speculators_model_type: "dspark"`, `speculators_config` with
`algorithm: "dspark"` and `proposal_methods[0].speculative_tokens = gamma`, modelled on
speculators' eagle3 config: ASSUMED, no speculators or vLLM release that names "dspark" was found
in the index), and ours: `dspark_config.temperatures` (the per-position calibration) and
`dspark_config.anchor_predicts` (true: the paper's readout, every slot a position; false: DFlash's
slots 1..B-1, a head made over a frozen DFlash backbone, which DeepSpec's loader does not know:
only Outrider drafts such a head as trained). Tensors:

    fc.weight, hidden_norm.weight, norm.weight, layers.{l}.*     as DFlash (heads/dflash/format.py)
    lm_head.weight, d2t, t2d                                    only for a reduced draft vocabulary
    markov_head.prev_embed.weight                               [V, r]   W1
    markov_head.out_proj.weight                                 [Vd, r]  W2
    markov_head.gate_proj.weight                                [r, H + r] gated / [r, 2r + H] rnn
    markov_head.{cand_proj,mix_proj}.weight                     [r, 2r + H] rnn
    confidence_head.proj.weight, confidence_head.proj.bias      [1, H + r], [1]

DeepSpec's checkpoint also holds the target's embed_tokens and lm_head; we leave them out (the
head shares the target's, as our DFlash export does). DeepSpec's markov_head.py was not in the
index, so the Markov tensor names are ours (ASSUMED), written down here and in docs/methods.md.
Target layer ids follow DFlash's convention (id l = the output of layer l, 0-based; DeepSpec's
too: hidden_states[l + 1]).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ...errors import ModelError
from ..dflash.format import expected_shapes as backbone_shapes
from ..dflash.format import misfit as backbone_misfit
from ..dflash.format import runtime_weights
from ..dflash.head import DFlashConfig, DFlashHead
from ..files import open_weights, read_raw, read_weight
from .head import DSparkConfig, DSparkHead
from .markov import VARIANTS, ConfidenceHead, MarkovHead

WHAT = "a DSpark head"
ARCHITECTURE = "Qwen3DSparkModel"


def is_dspark(raw: dict) -> bool:
    """Does this config.json describe a DSpark head?"""
    return (raw.get("speculators_model_type") == "dspark" or "markov_rank" in raw
            or any("dspark" in str(a).lower() for a in raw.get("architectures") or []))


def read_config(folder: str | Path) -> DSparkConfig:
    """config.json checked field by field (no weights read)."""
    path = Path(folder) / "config.json"
    raw = read_raw(folder, what=WHAT)
    if not is_dspark(raw):
        raise ModelError(f"{path}: architectures {raw.get('architectures')} name no DSpark head (expected "
                         f"{ARCHITECTURE}); point it at a DSpark head folder")
    try:
        hidden, heads, vocab = int(raw["hidden_size"]), int(raw["num_attention_heads"]), int(raw["vocab_size"])
        ids = raw["target_layer_ids"]
        if not isinstance(ids, list) or not ids or not all(type(i) is int for i in ids):
            raise ModelError(f"{path}: target_layer_ids must be a non-empty list of integers, got {ids!r}")
        draft = raw.get("draft_vocab_size")
        backbone = DFlashConfig(
            hidden_size=hidden, target_hidden_size=int(raw.get("target_hidden_size") or hidden), vocab_size=vocab,
            num_layers=int(raw["num_hidden_layers"]), num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads), head_dim=int(raw.get("head_dim") or hidden // heads),
            intermediate_size=int(raw["intermediate_size"]), rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_theta", 1000000.0)), block_size=int(raw["block_size"]),
            mask_token_id=int(raw["mask_token_id"]), target_layer_ids=tuple(ids),
            draft_vocab_size=None if draft is None or int(draft) == vocab else int(draft),
            num_target_layers=int(raw["num_target_layers"]) if raw.get("num_target_layers") is not None else None)
        variant, rank = str(raw["markov_head_type"]), int(raw["markov_rank"])
        extra = raw.get("dspark_config") or {}
        temps = extra.get("temperatures") or []
        spec = DSparkConfig(backbone, variant, rank, bool(raw.get("enable_confidence_head", True)),
                            tuple(float(t) for t in temps), bool(extra.get("anchor_predicts", True)))
    except KeyError as missing:
        raise ModelError(f"{path}: missing field {missing}; is this a DSpark head's config.json?") from None
    except (TypeError, ValueError) as err:
        raise ModelError(f"{path}: a field has the wrong type ({err}); re-export the head") from None
    if variant not in VARIANTS:
        raise ModelError(f"{path}: markov_head_type {variant!r} is none of {', '.join(VARIANTS)}")
    if rank < 1:
        raise ModelError(f"{path}: markov_rank must be at least 1 (got {rank}); DSpark without its Markov head is DFlash")
    if spec.temperatures and (len(spec.temperatures) != spec.gamma or min(spec.temperatures) <= 0):
        raise ModelError(f"{path}: dspark_config.temperatures must be {spec.gamma} positive numbers "
                         f"(one a position), got {list(spec.temperatures)}")
    return spec


def misfit(spec: DSparkConfig, target_config) -> str | None:
    """Why this head cannot draft for the target, or None."""
    if spec.gamma < 1:
        return f"block_size {spec.backbone.block_size} drafts {spec.gamma} positions; it must draft at least 1"
    c = spec.backbone
    if c.block_size < 2:  # the backbone's own rule; a one-slot DSpark block is still a prediction
        c = DFlashConfig(**{**c.__dict__, "block_size": 2})
    return backbone_misfit(c, target_config)


def expected_shapes(spec: DSparkConfig, num_target_layers: int) -> tuple[dict, dict]:
    """(required, optional) tensor name -> shape."""
    required, optional = backbone_shapes(spec.backbone, num_target_layers)
    c, r = spec.backbone, spec.markov_rank
    H, V, Vd = c.hidden_size, c.vocab_size, c.draft_vocab_size or c.vocab_size
    required["markov_head.prev_embed.weight"] = (V, r)
    required["markov_head.out_proj.weight"] = (Vd, r)
    width = {"vanilla": 0, "gated": H + r, "rnn": 2 * r + H}[spec.markov_variant]
    for name in {"vanilla": (), "gated": ("gate_proj",), "rnn": ("gate_proj", "cand_proj", "mix_proj")}[spec.markov_variant]:
        required[f"markov_head.{name}.weight"] = (r, width)
    if spec.confidence:
        required["confidence_head.proj.weight"] = (1, H + r)
        required["confidence_head.proj.bias"] = (1,)
    return required, optional


def head_from_tensors(tensors: dict[str, torch.Tensor], spec: DSparkConfig, target, where: str = "the head") -> DSparkHead:
    """A DSparkHead from tensors under the names above, on the target's device and dtype."""
    backbone = DFlashHead(spec.backbone, runtime_weights(tensors, spec.backbone, target, where=where))
    c = spec.backbone
    markov = MarkovHead(spec.markov_variant, spec.markov_rank, c.hidden_size, c.vocab_size, c.draft_vocab_size)
    conf = ConfidenceHead(c.hidden_size, spec.markov_rank) if spec.confidence else None
    with torch.no_grad():
        for module, prefix in ((markov, "markov_head."), (conf, "confidence_head.")):
            if module is None:
                continue
            for name, param in module.named_parameters():
                param.copy_(tensors[prefix + name].float())
    markov = markov.to(device=target.device, dtype=target.dtype).eval()
    conf = conf.to(device=target.device, dtype=target.dtype).eval() if conf is not None else None
    return DSparkHead(spec, backbone, markov, conf)


def read_tensors(folder: str | Path) -> dict[str, torch.Tensor]:
    folder = Path(folder)
    tensors = open_weights(folder, what=WHAT)
    return {n: read_weight(tensors, folder, n) for n in tensors.keys()}


def load_dspark(folder: str | Path, target) -> DSparkHead:
    """Load the head in `folder` to draft for `target` (a Decoder), sharing its embedding and readout."""
    folder = Path(folder)
    spec = read_config(folder)
    reason = misfit(spec, target.config)
    if reason:
        raise ModelError(f"DSpark head {folder}: {reason}")
    tensors = open_weights(folder, what=WHAT)
    names = set(tensors.keys())
    required, optional = expected_shapes(spec, target.config.num_layers)
    missing = [n for n in required if n not in names]
    if missing:
        raise ModelError(f"DSpark head {folder}: model.safetensors lacks tensor(s) {', '.join(missing[:4])}; "
                         "the export is incomplete: re-export the head")
    for name, shape in {**required, **{n: s for n, s in optional.items() if n in names}}.items():
        got = tuple(tensors.get_slice(name).get_shape())
        if got != shape:
            raise ModelError(f"DSpark head {folder}: tensor {name} has shape {list(got)} but its config.json says "
                             f"{list(shape)}; the config and the weights disagree: re-export the head")
    stored = {n: read_weight(tensors, folder, n) for n in names if n in required or n in optional}
    return head_from_tensors(stored, spec, target, where=str(folder))


def config_json(spec: DSparkConfig, *, dtype: str, num_target_layers: int | None = None,
                verifier: str | None = None) -> dict:
    """config.json (module docstring)."""
    c = spec.backbone
    n_layers = num_target_layers or c.num_target_layers
    if n_layers is None:
        raise ModelError("the head records no num_target_layers: pass the target to export it")
    config = {
        "architectures": [ARCHITECTURE], "model_type": "qwen3",
        "num_hidden_layers": c.num_layers, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "hidden_act": "silu", "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False,
        "vocab_size": c.vocab_size, "target_hidden_size": c.target_hidden_size, "num_target_layers": n_layers,
        "block_size": c.block_size, "mask_token_id": c.mask_token_id,
        "target_layer_ids": list(c.layer_ids(n_layers)), "layer_types": ["full_attention"] * c.num_layers,
        "enable_confidence_head": spec.confidence, "confidence_head_with_markov": spec.confidence,
        "markov_rank": spec.markov_rank, "markov_head_type": spec.markov_variant, "torch_dtype": dtype,
        "dspark_config": {"temperatures": list(spec.temperatures) or [1.0] * spec.gamma,
                          "anchor_predicts": spec.anchor_predicts},
        "speculators_model_type": "dspark",
        "speculators_config": {"algorithm": "dspark",
                               "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": spec.gamma}],
                               "default_proposal_method": "greedy",
                               "verifier": {"name_or_path": verifier, "architectures": []}},
    }
    if c.draft_vocab_size is not None:
        config["draft_vocab_size"] = c.draft_vocab_size
    return config
