"""The EAGLE-3 head in vllm-project/speculators' layout: its config.json, read and written.

The field list below is read from the speculators 0.9.0 wheel (the package is not a dependency:
it pulls a CUDA torch), files
    speculators/models/eagle3/config.py   Eagle3SpeculatorConfig (the top-level fields)
    speculators/config.py                 SpeculatorModelConfig, SpeculatorsConfig, VerifierConfig
    speculators/proposals/greedy.py       GreedyTokenProposalConfig
and from how vLLM loads it (vllm/transformers_utils/configs/speculators/{base,algos}.py: it needs
speculators_config.proposal_methods[0].speculative_tokens and verifier.name_or_path, builds the
draft's config from transformer_layer_config, passes eagle_aux_hidden_state_layer_ids through
as-is, i.e. with "vllm" semantics, and defaults a missing norm_before_residual to True while the
speculators class defaults it to False: so we always write it). A config.json in this layout:

    {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
     "transformer_layer_config": {"model_type": "llama", "vocab_size": V, "hidden_size": H, ...,
                                  "num_hidden_layers": 1},
     "draft_vocab_size": Vd, "target_hidden_size": Ht, "norm_before_residual": false,
     "eagle_aux_hidden_state_layer_ids": [2, 15, 27],            # vllm semantics
     "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
         "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 4}],
         "verifier": {"name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct",
                      "architectures": ["LlamaForCausalLM"]}}}

Tensors are those of the EAGLE layout with `layers.0.` for `midlayer.` (speculators' module is
a ModuleList `layers`; vLLM and recent SGLang map either name).
"""

from __future__ import annotations

from .head import Eagle3Config
from ..files import field_problems, json_is

SPECULATORS_VERSION = "0.9.0"  # the release whose source the field list follows

# (field, JSON type, required): the types pydantic declares; "required" is what the class or
# vLLM's loader needs, or what Outrider needs to know the head's shapes.
TOP_FIELDS = (
    ("speculators_model_type", "str", True),  # Literal["eagle3"]
    ("architectures", "list[str]", False),  # default ["Eagle3Speculator"]
    ("transformer_layer_config", "dict", True),  # a PretrainedConfig dict; model_type picks the class
    ("draft_vocab_size", "int", False),  # default 32000
    ("norm_before_residual", "bool", False),  # default False (vLLM: True when absent)
    ("target_hidden_size", "int|None", False),
    ("eagle_aux_hidden_state_layer_ids", "list[int]|None", False),
    ("norm_before_fc", "bool", False),
    ("fc_norm", "bool", False),  # exclusive with norm_before_fc
    ("norm_output", "bool", False),
    ("embed_requires_grad", "bool", False),
    ("speculators_version", "str", False),
    ("speculators_config", "dict", True),  # the class allows None; vLLM's loader requires it
)
SPECULATORS_CONFIG_FIELDS = (  # SpeculatorsConfig: every field required
    ("algorithm", "str", True),
    ("proposal_methods", "list[dict]", True),
    ("default_proposal_method", "str", True),  # must be the proposal_type of one method
    ("verifier", "dict", True),
)
VERIFIER_FIELDS = (("name_or_path", "str|None", True), ("architectures", "list[str]", True))
GREEDY_FIELDS = (  # GreedyTokenProposalConfig, the only proposal type 0.9.0 registers
    ("proposal_type", "str", True),
    ("speculative_tokens", "int", False),  # >= 1, default 5
    ("verifier_accept_k", "int", False),  # >= 1
    ("accept_tolerance", "float", False),  # >= 0
)
LAYER_FIELDS = (  # transformer_layer_config, a LlamaConfig: what Outrider reads
    ("model_type", "str", True),
    ("vocab_size", "int", True),  # Outrider: the target vocabulary V (t2d's length)
    ("hidden_size", "int", True),
    ("intermediate_size", "int", True),
    ("num_hidden_layers", "int", True),
    ("num_attention_heads", "int", True),
    ("num_key_value_heads", "int|None", False),
    ("head_dim", "int|None", False),
    ("rms_norm_eps", "float", False),
    ("rope_theta", "float", False),
    ("rope_parameters", "dict|None", False),
    ("hidden_act", "str", False),
    ("attention_bias", "bool", False),
    ("mlp_bias", "bool", False),
    ("tie_word_embeddings", "bool", False),
)


def schema_problems(raw: dict) -> list[str]:
    """What speculators 0.9.0's Eagle3SpeculatorConfig (and vLLM's loader) would refuse in `raw`,
    one short phrase each; [] when it conforms."""
    problems = field_problems(raw, TOP_FIELDS, "")
    if raw.get("speculators_model_type") not in (None, "eagle3"):
        problems.append(f"speculators_model_type is {raw['speculators_model_type']!r}, not 'eagle3'")
    if raw.get("norm_before_fc") is True and raw.get("fc_norm") is True:
        problems.append("norm_before_fc and fc_norm are both true (mutually exclusive)")
    layer = raw.get("transformer_layer_config")
    if isinstance(layer, dict):
        problems += field_problems(layer, LAYER_FIELDS, "transformer_layer_config.")
    spec = raw.get("speculators_config")
    if not isinstance(spec, dict):
        return problems
    problems += field_problems(spec, SPECULATORS_CONFIG_FIELDS, "speculators_config.")
    if "algorithm" in spec and spec["algorithm"] != "eagle3":
        problems.append(f"speculators_config.algorithm is {spec['algorithm']!r}, not 'eagle3'")
    if isinstance(spec.get("verifier"), dict):
        problems += field_problems(spec["verifier"], VERIFIER_FIELDS, "speculators_config.verifier.")
    methods = spec.get("proposal_methods")
    if isinstance(methods, list) and all(isinstance(m, dict) for m in methods):
        problems += _method_problems(methods, spec.get("default_proposal_method"))
    return problems


def _method_problems(methods: list[dict], default) -> list[str]:
    if not methods:
        return ["speculators_config.proposal_methods is empty (vLLM reads the first)"]
    problems = []
    for i, m in enumerate(methods):
        where = f"speculators_config.proposal_methods[{i}]."
        problems += field_problems(m, GREEDY_FIELDS, where)
        if m.get("proposal_type", "greedy") != "greedy":
            problems.append(f"{where}proposal_type {m['proposal_type']!r} is not one speculators 0.9.0 knows "
                            "('greedy')")
        for key, low in (("speculative_tokens", 1), ("verifier_accept_k", 1), ("accept_tolerance", 0)):
            if json_is(m.get(key), "float") and m[key] < low:
                problems.append(f"{where}{key} must be >= {low}, got {m[key]}")
    if "speculative_tokens" not in methods[0]:
        problems.append("speculators_config.proposal_methods[0].speculative_tokens is missing (vLLM needs it)")
    types = [m.get("proposal_type") for m in methods]
    if isinstance(default, str) and default not in types:
        problems.append(f"speculators_config.default_proposal_method {default!r} is not the proposal_type "
                        f"of a proposal method ({types})")
    return problems


def runtime_problems(raw: dict) -> list[str]:
    """Valid speculators choices that Outrider's EAGLE-3 runtime (heads/eagle3/head.py) does not run."""
    layer = raw.get("transformer_layer_config") or {}
    problems = []
    if layer.get("model_type", "llama") != "llama":
        problems.append(f"transformer_layer_config.model_type {layer['model_type']!r} is not supported "
                        "(Outrider runs llama decoder layers, without q_norm/k_norm)")
    if layer.get("num_hidden_layers", 1) != 1:
        problems.append(f"transformer_layer_config.num_hidden_layers is {layer['num_hidden_layers']}; "
                        "Outrider runs one-layer EAGLE-3 heads")
    for flag in ("norm_before_fc", "fc_norm", "norm_output"):
        if raw.get(flag):
            problems.append(f"{flag} is true; Outrider's EAGLE-3 runtime has no such norm")
    for flag in ("attention_bias", "mlp_bias"):
        if layer.get(flag):
            problems.append(f"transformer_layer_config.{flag} is true; Outrider's EAGLE-3 runtime has no biases")
    return problems


def config_from_speculators(raw: dict) -> Eagle3Config:
    """Eagle3Config of a conforming speculators config.json (check `schema_problems` and
    `runtime_problems` first). Layer ids keep speculators' (= vLLM's) semantics."""
    layer = raw["transformer_layer_config"]
    hidden, heads = int(layer["hidden_size"]), int(layer["num_attention_heads"])
    rope = layer.get("rope_parameters") or {}
    ids = raw.get("eagle_aux_hidden_state_layer_ids")
    return Eagle3Config(
        hidden_size=hidden,
        target_hidden_size=int(raw.get("target_hidden_size") or hidden),
        vocab_size=int(layer["vocab_size"]),
        draft_vocab_size=int(raw.get("draft_vocab_size", 32000)),
        num_heads=heads,
        num_kv_heads=int(layer.get("num_key_value_heads") or heads),
        head_dim=int(layer.get("head_dim") or hidden // heads),
        intermediate_size=int(layer["intermediate_size"]),
        rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
        rope_theta=float(layer.get("rope_theta", rope.get("rope_theta", 10000.0))),
        norm_before_residual=bool(raw.get("norm_before_residual", False)),
        layer_ids=None if ids is None else tuple(ids),
        layer_convention="vllm",
    )


def speculators_config(c: Eagle3Config, layer_ids: list[int], *, dtype: str, max_positions: int,
                       speculative_tokens: int, verifier: str, verifier_architectures: list[str]) -> dict:
    """config.json of the speculators layout for head `c` whose target layers, in vllm
    semantics, are `layer_ids`."""
    layer = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "num_hidden_layers": 1,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "hidden_act": "silu", "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "max_position_embeddings": max_positions, "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": False, "torch_dtype": dtype,
    }
    return {
        "speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
        "speculators_version": SPECULATORS_VERSION, "torch_dtype": dtype,
        "transformer_layer_config": layer,
        "draft_vocab_size": c.draft_vocab_size, "target_hidden_size": c.target_hidden_size,
        "norm_before_residual": c.norm_before_residual, "norm_before_fc": False, "fc_norm": False,
        "norm_output": False, "embed_requires_grad": False,
        "eagle_aux_hidden_state_layer_ids": list(layer_ids),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
        },
    }


def class_check(raw: dict) -> tuple[str, str]:
    """("ok" | "FAIL" | "skipped", detail): does the installed speculators package's own config
    class accept `raw`? Skipped when the package is not importable here."""
    try:
        from speculators import SpeculatorModelConfig  # optional, never a dependency
    except Exception:  # ImportError, or an install that fails to import  # noqa: BLE001
        return "skipped", "speculators not installed"
    try:
        config = SpeculatorModelConfig.from_dict(dict(raw))
    except Exception as err:  # pydantic's ValidationError and whatever the class raises  # noqa: BLE001
        try:  # a pydantic ValidationError: each error's field path and message, on one line
            detail = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
        except Exception:  # noqa: BLE001
            detail = " ".join(str(err).split()) or type(err).__name__
        return "FAIL", detail
    return "ok", type(config).__name__
