"""`outrider check-head DIR --target NAME`: does an EAGLE-3 head folder conform, and draft as recorded?

One `Check` per line, each ok, FAIL (with what to do) or skipped (with why), in this order:

    layout             eagle (EAGLE / SpecForge) or speculators, from config.json
    weights file       model.safetensors is there and whole (a truncated or corrupt file is said
                       so here, first, and the checks of its tensors are skipped)
    config fields      present with their JSON types (eagle: the LlamaConfig fields the engines
                       read, tie_word_embeddings false; speculators: the field list read from
                       speculators 0.9.0's source, heads/eagle3/speculators.py), and runnable here
    speculators class  the installed `speculators` package's own config class accepts config.json
                       (skipped where the package is not importable: it is never a dependency)
    target             the head reads this target's hidden size and vocabulary
    tensors            names (the layout's decoder-layer prefix), shapes against the config and
                       the target, dtypes (floats all one dtype, the config's torch_dtype; d2t
                       int64, t2d bool); nothing missing, nothing extra
    vocab map          t2d has exactly Vd true entries; d + d2t[d] is the d-th true index of t2d
    layer ids          the stored ids, under the stored convention, are layers of this target
    golden logits      what the head computes on the golden's fixed inputs (heads/golden_compute.py)
    golden tau         outrider_golden.json re-measured (heads/eagle3/golden.py)

config fields also needs `norm_before_residual` in both layouts: engines default it differently
(EAGLE's code false, vLLM's speculators loader true), so a head without it drafts
differently by engine; our exports always write it.

`check_head` returns the checks; any FAIL makes the CLI exit non-zero. The golden run loads the
target and the head, so it runs only when every other check passed.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from ...errors import OutriderError
from ..files import WEIGHTS, read_raw
from .format import expected_shapes, layer_prefix, layout, misfit, read_config
from ..checks import FLOATS, Check, dtype_problems, golden_last, shape_problems, target_of, weights_check
from .golden import measure
from .speculators import class_check, schema_problems
from ..files import field_problems

EAGLE_FIELDS = (  # what vLLM's and SGLang's LlamaForCausalLMEagle3 read from the EAGLE layout
    ("architectures", "list[str]", True),
    ("num_hidden_layers", "int", True),
    ("hidden_size", "int", True),
    ("intermediate_size", "int", True),
    ("num_attention_heads", "int", True),
    ("num_key_value_heads", "int", False),
    ("head_dim", "int", False),
    ("vocab_size", "int", True),
    ("draft_vocab_size", "int", True),
    ("target_hidden_size", "int|None", False),
    ("rms_norm_eps", "float", False),
    ("rope_theta", "float", False),
    ("tie_word_embeddings", "bool", True),
    ("norm_before_residual", "bool", False),
    ("eagle_config", "dict", False),
    ("eagle_aux_hidden_state_layer_ids", "list[int]", False),
)


def check_head(folder: str | Path, target: str | Path, *, device: str | None = None,
               golden: bool = True) -> list[Check]:
    """Every check of the module docstring on the head in `folder` for `target` (catalog name or folder)."""
    folder = Path(folder)
    checks: list[Check] = []
    add = lambda *args: checks.append(Check(*args)) or checks[-1]  # noqa: E731
    try:
        raw = read_raw(folder)
    except OutriderError as err:
        add("layout", "FAIL", str(err))
        return checks
    kind = layout(raw)
    add("layout", "ok", {"eagle": "eagle: EAGLE / SpecForge, for vLLM and SGLang",
                         "speculators": "speculators: vllm-project/speculators, for vLLM"}[kind])
    header = weights_check(folder, add)
    config = _config_check(folder, raw, kind, add)
    _class_check(raw, kind, add)
    target_path, tcfg = _target_check(target, config, header, add)
    names = _tensors_check(folder, kind, config, tcfg, header, raw, add)
    _vocab_check(folder, config, names, add)
    _layers_check(config, tcfg, add)
    golden_last(checks, add, golden, folder, target_path, device, measure, "outrider export eagle3")
    return checks


def _config_check(folder: Path, raw: dict, kind: str, add):
    if kind == "speculators":
        problems = schema_problems(raw)
    else:
        problems = field_problems(raw, EAGLE_FIELDS)
        if not any("eagle3" in str(a).lower() for a in raw.get("architectures") or []):
            problems.append(f"architectures {raw.get('architectures')} name no EAGLE-3 head "
                            "(vLLM and SGLang load LlamaForCausalLMEagle3)")
        if raw.get("num_hidden_layers", 1) != 1:
            problems.append(f"num_hidden_layers is {raw['num_hidden_layers']}, not 1")
        if raw.get("tie_word_embeddings") is True:
            problems.append("tie_word_embeddings is true (SGLang would tie lm_head to the embedding)")
    if problems:
        add("config fields", "FAIL", f"{'; '.join(problems)}: fix config.json or re-export the head")
        return None
    try:
        config = read_config(folder)
    except OutriderError as err:
        add("config fields", "FAIL", str(err))
        return None
    if "norm_before_residual" not in raw:  # the head reads (as false): the other checks still run
        add("config fields", "FAIL", "norm_before_residual is missing (EAGLE's code reads false, vLLM's speculators "
                                     "loader true): write it in config.json or re-export the head")
    else:
        add("config fields", "ok", f"H {config.hidden_size}, Vd {config.draft_vocab_size} of V {config.vocab_size}")
    return config


def _class_check(raw: dict, kind: str, add) -> None:
    if kind != "speculators":
        add("speculators class", "skipped", "eagle layout (no speculators config to validate)")
        return
    status, detail = class_check(raw)
    if status == "skipped":
        detail += " (config fields were checked against the field list of speculators 0.9.0's source instead)"
    elif status == "FAIL":
        detail = f"speculators refuses config.json: {detail}; fix the field it names or re-export the head"
    add("speculators class", status, detail)


def _target_check(target, config, header: dict | None, add):
    target_path, tcfg = target_of(target, add)
    if tcfg is None:
        return None, None
    if config is None:
        add("target", "skipped", "needs a readable config.json")
        return target_path, tcfg
    sizes_only = dataclasses.replace(config, layer_ids=None, layer_convention="vllm")  # ids: their own check
    if header is None:  # no readable weights (the weights file check said so): the sizes alone
        reason = misfit(sizes_only, tcfg, True, True)
    else:
        reason = misfit(sizes_only, tcfg, "embed_tokens.weight" in header, "lm_head.weight" in header)
    if reason:
        add("target", "FAIL", reason)
    else:
        add("target", "ok", f"{target}: hidden {tcfg.hidden_size}, vocab {tcfg.vocab_size}, {tcfg.num_layers} layers")
    return target_path, tcfg


def _tensors_check(folder: Path, kind: str, config, tcfg, header: dict | None, raw: dict, add) -> dict | None:
    if header is None:
        add("tensors", "skipped", f"needs a readable {WEIGHTS} (weights file)")
        return None
    if config is None:
        add("tensors", "skipped", "needs a readable config.json")
        return header
    prefix = layer_prefix(header)
    want = {"eagle": "midlayer.", "speculators": "layers.0."}[kind]
    required, optional = expected_shapes(config, want)
    problems = []
    if any(n.startswith("midlayer.") for n in header) and any(n.startswith("layers.0.") for n in header):
        problems.append("both midlayer.* and layers.0.* tensors")
    elif prefix != want and any(n.startswith(prefix) for n in header):
        problems.append(f"decoder-layer tensors are named {prefix}* but the {kind} layout loads {want}*")
        required = {(prefix + n[len(want):] if n.startswith(want) else n): s for n, s in required.items()}
    problems += shape_problems(header, required, optional, "not part of an EAGLE-3 head")
    for name, (_, dtype) in header.items():
        if name == "d2t" and dtype != torch.int64:
            problems.append(f"d2t is {dtype}, engines expect int64")
        elif name == "t2d" and dtype != torch.bool:
            problems.append(f"t2d is {dtype}, engines expect bool")
        elif name not in ("d2t", "t2d") and dtype not in FLOATS:
            problems.append(f"{name} is {dtype}, not a float16/bfloat16/float32 tensor")
    problems += dtype_problems(header, raw)
    if problems:
        add("tensors", "FAIL", f"{'; '.join(problems)}: re-export the head with `outrider export eagle3`")
    else:
        add("tensors", "ok", f"{len(header)} tensors, {prefix}*, fc reads 3 x {config.target_hidden_size}")
    return header


def _vocab_check(folder: Path, config, names, add) -> None:
    if config is None or names is None:
        add("vocab map", "skipped", "needs a readable config.json and weights")
        return
    if config.draft_vocab_size == config.vocab_size and "d2t" not in names:
        add("vocab map", "skipped", "no draft vocabulary: the head predicts the whole target vocabulary")
        return
    if "d2t" not in names or "t2d" not in names:
        add("vocab map", "FAIL", "d2t or t2d is missing; re-export the head with its draft vocabulary maps")
        return
    from safetensors import safe_open

    with safe_open(str(folder / WEIGHTS), framework="pt") as f:
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    Vd = config.draft_vocab_size
    kept = torch.nonzero(t2d.bool()).flatten()  # [count] target ids marked, ascending
    if kept.numel() != Vd or d2t.numel() != Vd:
        add("vocab map", "FAIL", f"t2d marks {kept.numel()} target tokens and d2t has {d2t.numel()} entries, "
                                 f"draft_vocab_size is {Vd}; the vocab map is corrupt: re-export the head")
        return
    ids = torch.arange(Vd) + d2t.long()  # [Vd] target id of draft id d
    bad = torch.nonzero(ids != kept).flatten()
    if bad.numel():
        d = int(bad[0])
        add("vocab map", "FAIL", f"d2t maps draft id {d} to target id {int(ids[d])} but the {d}-th true entry of t2d "
                                 f"is {int(kept[d])} ({bad.numel()} draft ids disagree); the vocab map is corrupt: "
                                 "re-export the head")
        return
    add("vocab map", "ok", f"{Vd} draft tokens, d2t inverts t2d")


def _layers_check(config, tcfg, add) -> None:
    if config is None or tcfg is None:
        add("layer ids", "skipped", "needs a readable config.json and target")
        return
    taps = config.taps(tcfg.num_layers)
    stored = "none stored (default 2, N//2, N-3)" if config.layer_ids is None else \
        f"{list(config.layer_ids)} ({config.layer_convention} semantics)"
    if any(not 0 <= t < tcfg.num_layers for t in taps):
        add("layer ids", "FAIL", f"{stored} are hidden states {list(taps)} but the target has {tcfg.num_layers} "
                                 f"layers (0..{tcfg.num_layers - 1}); use a head made for this target or fix "
                                 "eagle_aux_hidden_state_layer_ids")
    else:
        add("layer ids", "ok", f"{stored} = hidden states {list(taps)} of {tcfg.num_layers} layers")
