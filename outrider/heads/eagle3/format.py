"""The EAGLE-3 head on disk: the EAGLE / SpecForge layout that vLLM and SGLang load.

A folder with `config.json` (a LlamaConfig: architectures ["LlamaForCausalLMEagle3"],
num_hidden_layers 1, vocab_size V, draft_vocab_size Vd, optional target_hidden_size Ht,
norm_before_residual, and eagle_config {eagle_aux_hidden_state_layer_ids, eagle_aux_layer_semantics})
and `model.safetensors` (never pickles):

    fc.weight                                         [H, 3Ht]
    midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight   [H]
    midlayer.self_attn.{q,k,v}_proj.weight            [nh*d, 2H] / [nkv*d, 2H]
    midlayer.self_attn.o_proj.weight                  [H, nh*d]
    midlayer.mlp.{gate,up}_proj.weight / down_proj    [I, H] / [H, I]
    norm.weight                                       [H]
    lm_head.weight  (optional: else the target's)     [Vd, H]
    d2t int64 / t2d bool (when Vd < V)                [Vd] / [V]: target id = d + d2t[d]
    embed_tokens.weight  (optional: else the target's) [V, H]

`layers.0.` is accepted for `midlayer.`. Layer ids: "vllm" semantics (the default, EAGLE's and
vLLM's) index Hugging Face hidden_states, the residual entering layer l; "sglang" (SpecForge,
SGLang) count the output of layer l; without ids the head reads 2, N//2, N-3 ("vllm"). vLLM reads
top-level `eagle_aux_hidden_state_layer_ids` first (semantics from a top-level
`eagle_aux_layer_semantics`), SGLang the ones in `eagle_config` (adding 1): we read eagle_config's
(with its `eagle_aux_layer_semantics`, default "vllm"), else the top-level ones, and refuse a
config whose two lists name different target layers.

A config.json with `speculators_model_type` is the vllm-project/speculators layout
(heads/eagle3/speculators.py): sizes in `transformer_layer_config`, ids with vllm semantics,
tensors under `layers.0.`. Every problem is a one-line ModelError naming the folder and saying
what to do.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ...errors import ConfigError, ModelError
from .head import Eagle3Config, Eagle3Head, Eagle3Weights
from .speculators import config_from_speculators, runtime_problems, schema_problems
from ..files import WEIGHTS, open_weights, read_raw, read_weight
from ..taps import CONVENTIONS
from ..vocab_map import draft_to_target


def layout(raw: dict) -> str:
    """"speculators" (vllm-project/speculators) or "eagle" (EAGLE / SpecForge)."""
    return "speculators" if "speculators_model_type" in raw else "eagle"


def read_config(folder: str | Path) -> Eagle3Config:
    """The head's config.json, checked field by field (no weights read), in either layout."""
    path = Path(folder) / "config.json"
    raw = read_raw(folder)
    if layout(raw) == "speculators":
        problems = schema_problems(raw) + runtime_problems(raw)
        if problems:
            raise ModelError(f"{path} (speculators layout): {problems[0]}; re-export the head")
        return config_from_speculators(raw)
    archs = raw.get("architectures") or []
    if not any("eagle3" in str(a).lower() for a in archs):
        raise ModelError(f"{path}: architectures {archs} name no EAGLE-3 head (expected LlamaForCausalLMEagle3); "
                         "point --drafter eagle3: at an EAGLE-3 head folder")
    ids, convention = _layer_ids(raw, path)
    try:
        hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
        vocab = int(raw["vocab_size"])
        rope = raw.get("rope_parameters") or {}
        return Eagle3Config(
            hidden_size=hidden,
            target_hidden_size=int(raw.get("target_hidden_size") or hidden),
            vocab_size=vocab,
            draft_vocab_size=int(raw.get("draft_vocab_size") or vocab),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            intermediate_size=int(raw["intermediate_size"]),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_theta", rope.get("rope_theta", 10000.0))),
            norm_before_residual=bool(raw.get("norm_before_residual", False)),
            layer_ids=ids,
            layer_convention=convention,
        )
    except KeyError as missing:
        raise ModelError(f"{path}: missing field {missing}; is this an EAGLE-3 head's config.json?") from None
    except (TypeError, ValueError) as err:
        raise ModelError(f"{path}: a field has the wrong type ({err}); re-export the head") from None


def _layer_ids(raw: dict, path: Path) -> tuple[tuple[int, ...] | None, str]:
    """(ids, convention) of an EAGLE-layout config: eagle_config's, else the top-level ones."""
    eagle = raw.get("eagle_config") or {}
    found = []
    for where, holder in (("eagle_config.", eagle), ("", raw)):
        ids = holder.get("eagle_aux_hidden_state_layer_ids")
        convention = holder.get("eagle_aux_layer_semantics", "vllm")
        if convention not in CONVENTIONS:
            raise ModelError(f"{path}: {where}eagle_aux_layer_semantics {convention!r} is unknown; "
                             f"use one of {CONVENTIONS}")
        if ids is None:
            continue
        if not isinstance(ids, list) or len(ids) != 3 or not all(type(i) is int for i in ids):
            raise ModelError(f"{path}: {where}eagle_aux_hidden_state_layer_ids must be three integers, got {ids!r}")
        found.append((tuple(ids), convention, where))
    if len(found) == 2:
        (a, ca, _), (b, cb, _) = found
        as_taps = lambda ids, c: tuple(i + 1 for i in ids) if c == "sglang" else ids  # as Eagle3Config.taps  # noqa: E731
        if as_taps(a, ca) != as_taps(b, cb):
            raise ModelError(f"{path}: eagle_config.eagle_aux_hidden_state_layer_ids {list(a)} ({ca}) and the "
                             f"top-level {list(b)} ({cb}) name different target layers (SGLang reads the first, "
                             "vLLM the second); re-export the head")
    return (found[0][0], found[0][1]) if found else (None, "vllm")


def misfit(config: Eagle3Config, target_config, has_embed: bool = False, has_lm_head: bool = True) -> str | None:
    """Why a head with `config` cannot draft for this target (hidden size, vocabulary, layers), or None."""
    c, t = config, target_config
    if c.target_hidden_size != t.hidden_size:
        return (f"the head reads target hidden states of size {c.target_hidden_size}, this target's are "
                f"{t.hidden_size}: it was made for another model; use a head trained for this target")
    if c.vocab_size != t.vocab_size:
        return (f"the head's vocabulary has {c.vocab_size} tokens, the target's {t.vocab_size}: "
                "it was made for another model; use a head trained for this target")
    if not 1 <= c.draft_vocab_size <= c.vocab_size:
        return f"draft_vocab_size {c.draft_vocab_size} must be between 1 and vocab_size {c.vocab_size}"
    if c.hidden_size != t.hidden_size and not has_embed:
        return (f"the head's hidden size {c.hidden_size} differs from the target's {t.hidden_size}, so it "
                "cannot share the target's embedding and needs its own embed_tokens.weight")
    if not has_lm_head and (c.hidden_size != t.hidden_size or c.draft_vocab_size != c.vocab_size):
        return "the head has no lm_head.weight and cannot share the target's (other hidden size or a draft vocabulary)"
    taps = c.taps(t.num_layers)
    if any(not 0 <= layer < t.num_layers for layer in taps):
        return (f"its layer ids {list(c.layer_ids or ())} ({c.layer_convention} semantics) are target layers "
                f"{list(taps)} but the target has {t.num_layers} layers (0..{t.num_layers - 1}); "
                "use a head made for this target")
    return None


# kinds a head's matrices may be kept in for drafting; "-i8": multiplied with int8 activations (native/qmatmul_i8.c)
HEAD_QUANTS = ("q8_0", "q4_0", "q4_1", "q8_0-i8", "q4_0-i8", "q4_1-i8")


def load_eagle3(folder: str | Path, target, quantize: str | None = None,
                vocab: torch.Tensor | None = None) -> Eagle3Head:
    """Load the head in `folder` to draft for `target` (a Decoder): its weights on the target's
    device and dtype, the target's embedding and lm_head shared unless the head has its own.

    quantize: keep the head's own matrices (fc, qkv, o, gate_up, down, its lm_head) as GGUF blocks
    of that kind (HEAD_QUANTS), multiplied by the native kernel where it runs (float32 only): a
    drafting step reads a quarter of the bytes. What the head proposes may change a little, never
    what is committed (the target verifies every draft).

    vocab: target ids ([n] long) the readout keeps (heads/eagle3/vocab.py; None: every draft id)."""
    folder = Path(folder)
    config = read_config(folder)
    tensors = open_weights(folder)
    names = set(tensors.keys())
    prefix = layer_prefix(names)
    reason = misfit(config, target.config, "embed_tokens.weight" in names, "lm_head.weight" in names)
    if reason:
        raise ModelError(f"EAGLE-3 head {folder}: {reason}")
    expected, optional = expected_shapes(config, prefix)
    missing = [n for n in expected if n not in names]
    if missing:
        raise ModelError(f"EAGLE-3 head {folder}: {WEIGHTS} lacks tensor(s) {', '.join(missing)}; "
                         "the export is incomplete: re-export the head")
    for name, shape in {**expected, **{n: s for n, s in optional.items() if n in names}}.items():
        got = tuple(tensors.get_slice(name).get_shape())
        if got != shape:
            raise ModelError(f"EAGLE-3 head {folder}: tensor {name} has shape {list(got)} but its config.json "
                             f"says {list(shape)}; the config and the weights disagree: re-export the head")
    maps_needed = "d2t" in expected
    device, dtype = target.device, target.dtype
    get = lambda name: read_weight(tensors, folder, name).to(device=device, dtype=dtype)  # noqa: E731
    attn, mlp = prefix + "self_attn.", prefix + "mlp."
    weights = Eagle3Weights(
        fc=get("fc.weight"),
        input_norm=get(prefix + "input_layernorm.weight"),
        hidden_norm=get(prefix + "hidden_norm.weight"),
        qkv=torch.cat([get(attn + f"{n}_proj.weight") for n in "qkv"]),
        o=get(attn + "o_proj.weight"),
        post_norm=get(prefix + "post_attention_layernorm.weight"),
        gate_up=torch.cat([get(mlp + "gate_proj.weight"), get(mlp + "up_proj.weight")]),
        down=get(mlp + "down_proj.weight"),
        norm=get("norm.weight"),
        lm_head=get("lm_head.weight") if "lm_head.weight" in names else target.lm_head,  # shared
        embed=get("embed_tokens.weight") if "embed_tokens.weight" in names else target.embed,  # shared
        draft_to_target=None,
    )
    if maps_needed:
        weights.draft_to_target = draft_to_target(read_weight(tensors, folder, "d2t"), read_weight(tensors, folder, "t2d"),
                                                  str(folder)).to(device)
    if vocab is not None:
        from .vocab import cut_readout

        config, weights = cut_readout(config, weights, vocab)
    if quantize is not None:  # the readout too when it is the head's own (or rows cut from a float one)
        own = isinstance(weights.lm_head, torch.Tensor) and weights.lm_head is not target.lm_head
        _quantize_matrices(weights, quantize, own_lm_head=own, dtype=dtype)
    return Eagle3Head(config, weights)


def _quantize_matrices(w: Eagle3Weights, kind: str, own_lm_head: bool, dtype: torch.dtype) -> None:
    """Replace the head's float matrices by QuantLinear weights of `kind` (see load_eagle3)."""
    from ...kernels import native, quant_linear
    from ...kernels.blocks import quantize

    if kind not in HEAD_QUANTS:
        raise ConfigError(f"an EAGLE-3 head can draft in {', '.join(HEAD_QUANTS)} or its own float dtype, not {kind!r}")
    if dtype != torch.float32:
        raise ConfigError(f"a head kept in {kind} drafts in float32; this target computes in {dtype}")
    base, _, compute = kind.partition("-")
    if compute and not native.i8_available():
        raise ConfigError(f"an EAGLE-3 head in {kind} needs the int8-activation kernel (AVX2 or better), which does "
                          f"not run here; use @{base}")
    names = ["fc", "qkv", "o", "gate_up", "down"] + (["lm_head"] if own_lm_head else [])
    for name in names:
        if getattr(w, name).shape[1] % 32:
            continue  # rows that are not whole blocks stay float
        blocks = quantize(getattr(w, name), base)
        setattr(w, name, quant_linear.QuantLinear(blocks, dtype, quant_linear.choose_kernel(blocks, i8=bool(compute))))


def expected_shapes(c: Eagle3Config, prefix: str = "midlayer.") -> tuple[dict, dict]:
    """(required, optional): tensor name -> shape that config `c` implies; d2t/t2d are required
    when Vd < V, lm_head and embed_tokens are optional (else the target's)."""
    H, Ht, D, I = c.hidden_size, c.target_hidden_size, c.head_dim, c.intermediate_size
    required = {
        "fc.weight": (H, 3 * Ht),
        prefix + "input_layernorm.weight": (H,), prefix + "hidden_norm.weight": (H,),
        prefix + "post_attention_layernorm.weight": (H,),
        prefix + "self_attn.q_proj.weight": (c.num_heads * D, 2 * H),
        prefix + "self_attn.k_proj.weight": (c.num_kv_heads * D, 2 * H),
        prefix + "self_attn.v_proj.weight": (c.num_kv_heads * D, 2 * H),
        prefix + "self_attn.o_proj.weight": (H, c.num_heads * D),
        prefix + "mlp.gate_proj.weight": (I, H), prefix + "mlp.up_proj.weight": (I, H),
        prefix + "mlp.down_proj.weight": (H, I),
        "norm.weight": (H,),
    }
    if c.draft_vocab_size < c.vocab_size:
        required.update({"d2t": (c.draft_vocab_size,), "t2d": (c.vocab_size,)})
    optional = {"lm_head.weight": (c.draft_vocab_size, H), "embed_tokens.weight": (c.vocab_size, H)}
    return required, optional


def layer_prefix(names) -> str:
    """"midlayer." (EAGLE, SpecForge) or "layers.0." (speculators): the decoder layer's names."""
    return "midlayer." if any(n.startswith("midlayer.") for n in names) else "layers.0."


def read_tensors(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the head's model.safetensors exactly as stored (dtype and bits), on the
    CPU, with `layers.0.` named `midlayer.` (one naming for both layouts)."""
    folder = Path(folder)
    tensors = open_weights(folder)
    names = list(tensors.keys())
    prefix = layer_prefix(names)
    return {("midlayer." + n[len(prefix):] if n.startswith(prefix) else n): read_weight(tensors, folder, n)
            for n in names}


