"""Write an EAGLE-3 head in the layouts the big engines load: `eagle` and `speculators`.

    export_eagle3("heads/mine", "out/mine-eagle", "eagle", "smollm2-135m-instruct")
    export_eagle3(from_head(llm.speculator.drafter.head, llm.target), "out/x", "speculators", "...")

Both write `config.json` + `model.safetensors` (never pickles) + `outrider_golden.json`:

    layout       config.json                               decoder layer   layer ids
    eagle        LlamaConfig, architectures                midlayer.       top level: vllm semantics (vLLM
                 ["LlamaForCausalLMEagle3"],                               reads these); eagle_config: sglang
                 tie_word_embeddings false (SGLang ties                    semantics, labelled so (SGLang
                 lm_head to the embedding otherwise)                       reads these and adds 1)
    speculators  speculators_model_type "eagle3",          layers.0.       eagle_aux_hidden_state_layer_ids,
                 transformer_layer_config, verifier                        vllm semantics (as vLLM passes
                 (heads/eagle3/speculators.py)                             them through)

Tensors (heads/eagle3/format.py's table): floats in the head's dtype or `dtype`; d2t int64 and
t2d bool when Vd < V; lm_head only when the head has its own (a reduced one always); the
embedding only when the head carries its own (else every engine shares the target's). Layer ids
are always written explicitly, resolved against the target (a head without ids reads 2, N//2,
N-3). The folder is written under a temporary name beside `out` and renamed when complete; an
existing non-empty `out` is refused before any work.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ...errors import ConfigError, ModelError
from .head import Eagle3Config, Eagle3Head
from .format import expected_shapes, misfit, read_config, read_tensors
from ..golden import GoldenSettings, PROMPTS, record, write_golden
from .golden import measure
from .speculators import speculators_config
from ..staging import DTYPE_NAMES, DTYPES, check_out, staged_head

FORMATS = ("eagle", "speculators")
PREFIX = {"eagle": "midlayer.", "speculators": "layers.0."}
# Hugging Face ids of the catalog targets: a portable speculators verifier (`--verifier HF_ID`: vLLM
# then fetches it from the Hub). Ours are converted from GGUF files, close to these weights. The
# default verifier is the target's own folder (absolute): it loads offline, and it is the very model
# the golden tau is measured with.
HF_IDS = {"smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct",
          "qwen2.5-coder-0.5b-instruct": "Qwen/Qwen2.5-Coder-0.5B-Instruct",
          "qwen2.5-coder-1.5b-instruct": "Qwen/Qwen2.5-Coder-1.5B-Instruct"}


@dataclass
class HeadTensors:
    """A head as stored: its config and tensors under `midlayer.` names, dtype and bits kept."""

    config: Eagle3Config
    tensors: dict[str, torch.Tensor]


def from_folder(folder: str | Path) -> HeadTensors:
    """The head in `folder` (either layout), read exactly as stored."""
    return HeadTensors(read_config(folder), read_tensors(folder))


def from_head(head: Eagle3Head, target) -> HeadTensors:
    """A loaded head (heads/eagle3/head.py) in the dtype it runs in; `target` is the Decoder it was
    loaded for: its embedding and lm_head, shared, are left out."""
    c, w = head.config, head.w
    q_rows, kv_rows, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    q, k, v = w.qkv.split((q_rows, kv_rows, kv_rows))  # [nh*d, 2H], [nkv*d, 2H] x2
    gate, up = w.gate_up.split((inter, inter))  # [I, H] each
    p = "midlayer."
    tensors = {"fc.weight": w.fc, p + "input_layernorm.weight": w.input_norm, p + "hidden_norm.weight": w.hidden_norm,
               p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k, p + "self_attn.v_proj.weight": v,
               p + "self_attn.o_proj.weight": w.o, p + "post_attention_layernorm.weight": w.post_norm,
               p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up, p + "mlp.down_proj.weight": w.down,
               "norm.weight": w.norm}
    if w.lm_head is not target.lm_head:
        tensors["lm_head.weight"] = w.lm_head
    if w.embed is not target.embed:
        tensors["embed_tokens.weight"] = w.embed
    if w.draft_to_target is not None:
        ids = w.draft_to_target.long().cpu()  # [Vd]
        tensors["d2t"] = ids - torch.arange(ids.numel())
        t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        tensors["t2d"] = t2d
    return HeadTensors(c, {n: t.detach().cpu().contiguous() for n, t in tensors.items()})


def disk_tensors(head: HeadTensors, fmt: str, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The tensors under `fmt`'s names: floats cast to `dtype` (None: as stored), d2t int64,
    t2d bool; only the names the head's config implies (ModelError for a missing or misshapen one)."""
    required, optional = expected_shapes(head.config)
    missing = [n for n in required if n not in head.tensors]
    if missing:
        raise ModelError(f"the head lacks tensor(s) {', '.join(missing)}; it cannot be exported: re-train or "
                         "re-export it from its source")
    out = {}
    for name in [*required, *(n for n in optional if n in head.tensors)]:
        t = head.tensors[name]
        shape = required.get(name, optional.get(name))
        if tuple(t.shape) != shape:
            raise ModelError(f"the head's tensor {name} has shape {list(t.shape)} but its config says {list(shape)}; "
                             "the config and the weights disagree: fix the head before exporting it")
        if name == "d2t":
            t = t.to(torch.int64)
        elif name == "t2d":
            t = t.to(torch.bool)
        elif dtype is not None:
            t = t.to(dtype)
        disk = PREFIX[fmt] + name[len("midlayer."):] if name.startswith("midlayer.") else name
        out[disk] = t.contiguous()
    return out


def eagle_config(c: Eagle3Config, layer_ids: list[int], *, dtype: str, max_positions: int) -> dict:
    """config.json of the EAGLE layout; `layer_ids` in vllm semantics (see the module docstring)."""
    if min(layer_ids) < 1:
        raise ConfigError(f"the head reads target layer ids {layer_ids} (vllm semantics); SGLang cannot capture "
                          "the embeddings (id 0) in the eagle layout: export with --format speculators")
    return {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "hidden_act": "silu", "vocab_size": c.vocab_size, "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        "max_position_embeddings": max_positions, "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": False, "norm_before_residual": c.norm_before_residual, "torch_dtype": dtype,
        "eagle_aux_hidden_state_layer_ids": list(layer_ids),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in layer_ids],
                         "eagle_aux_layer_semantics": "sglang", "use_aux_hidden_state": True},
    }


def export_eagle3(source, out: str | Path, fmt: str, target: str | Path, *, dtype: str | None = None,
                  verifier: str | None = None, settings: GoldenSettings = GoldenSettings(), prompts=PROMPTS,
                  golden: bool = True, log=None) -> Path:
    """Write head `source` (a folder, or `from_head`/`from_folder`'s HeadTensors) for `target`
    (catalog name or folder) into `out` in layout `fmt`, with its golden tau; returns `out`.
    `verifier` (speculators): the name_or_path vLLM loads the target from; default the target's
    folder, absolute (loads offline, on this machine), e.g. a Hugging Face id for another machine."""
    import json

    from ...catalog.resolve import resolve_model
    from ...models.config import ModelConfig

    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt!r}: use one of {', '.join(FORMATS)}")
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: use bf16, fp16 or fp32 (or leave it out to keep the head's)")
    out = check_out(out)
    target_path = resolve_model(target)
    target_config = ModelConfig.load(target_path)
    if isinstance(source, Eagle3Head):
        raise TypeError("export_eagle3 takes a folder or HeadTensors: pass from_head(head, target_decoder)")
    head = source if isinstance(source, HeadTensors) else from_folder(source)
    reason = misfit(head.config, target_config, "embed_tokens.weight" in head.tensors,
                    "lm_head.weight" in head.tensors)
    if reason:
        raise ModelError(f"the head does not fit target {target}: {reason}")
    tensors = disk_tensors(head, fmt, DTYPES[dtype] if dtype else None)
    dropped = sorted(set(head.tensors) - {"midlayer." + n[len(PREFIX[fmt]):] if n.startswith(PREFIX[fmt]) else n
                                          for n in tensors})
    if dropped and log:
        log(f"left out tensor(s) that are no part of an EAGLE-3 head: {', '.join(dropped)}")
    dtype_name = DTYPE_NAMES.get(tensors["fc.weight"].dtype, str(tensors["fc.weight"].dtype).removeprefix("torch."))
    layer_ids = list(head.config.taps(target_config.num_layers))  # vllm semantics = our taps
    if fmt == "eagle":
        config = eagle_config(head.config, layer_ids, dtype=dtype_name,
                              max_positions=target_config.max_position_embeddings)
    else:
        raw_target = json.loads((target_path / "config.json").read_text())
        if verifier is None:
            verifier = str(Path(target_path).resolve())
            if log:
                portable = HF_IDS.get(str(target), "HF_ID")
                log(f"speculators verifier: {verifier} (this machine's folder: loads offline); for another "
                    f"machine export with --verifier {portable}")
        config = speculators_config(
            head.config, layer_ids, dtype=dtype_name, max_positions=target_config.max_position_embeddings,
            speculative_tokens=settings.depth, verifier=verifier,
            verifier_architectures=list(raw_target.get("architectures") or []))
    with staged_head(out, config, tensors) as work:
        if golden:
            if log:
                log(f"measuring the golden tau on {len(prompts)} prompts ({settings.device}, {settings.dtype})")
            measured = measure(work, target_path, settings, prompts)
            write_golden(work, record(measured, str(target), target_path, [target_config.architecture]))
    return out
