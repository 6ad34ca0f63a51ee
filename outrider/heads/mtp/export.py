"""Write an MTP head in the layout vLLM's `mtp` loader reads, and say what loads it.

    export_mtp("runs/my-mtp", "out/my-mtp", "vllm", "smollm2-135m-instruct")

`outrider` (the shipped layout) and `vllm` write config.json (heads/mtp/format.py `config_json`),
model.safetensors and outrider_golden.json; `vllm` adds the two [V, H] tensors vLLM's
DeepSeekMultiTokenPredictor loads per module (`model.layers.{N}.embed_tokens.weight`, read as
the model's embedding, and `shared_head.head.weight`), copied from the target.

Who loads what (the facts behind the layout, read at the versions named):
- vLLM (vllm-project/vllm 03356f8, `model_executor/models/deepseek_mtp.py`): the names above;
  `num_nextn_predict_layers` modules at layer ids N.. (mtp_start_layer_idx = num_hidden_layers);
  one module reused for every step (spec_step_idx % num_mtp_layers); the input is
  eh_proj(cat(enorm(embed), hnorm(previous_hidden))), embed zeroed at position 0. vLLM binds the
  `mtp` method to MTP model classes of particular architectures (DeepSeek, MiMo, GLM-4.5, Qwen3-Next,
  ...): it has none for a Llama target, so this export for SmolLM2 is the layout, not a model
  vLLM serves unchanged.
- llama.cpp (the vendored sources of the llama-cpp-python 0.3.36 sdist): `--spec-type draft-mtp`
  (common/speculative.cpp `common_speculative_impl_draft_mtp`) runs the target's own nextn
  layers: GGUF tensors `blk.{N}.nextn.{eh_proj,enorm,hnorm,embed_tokens,shared_head_head,
  shared_head_norm}` and the key `{arch}.nextn_predict_layers` (src/llama-arch.cpp), fed the
  target's hidden "before the final output norm" (src/llama-graph.h t_h_nextn). Only the
  architectures whose graphs build nextn layers load them (src/models/: deepseek2, glm4,
  glm4-moe, exaone4, qwen35, qwen3next, ...); llama.cpp's `llama` graph (src/models/llama.cpp)
  has none, so no GGUF is written for a Llama target: `--format gguf` is refused in one line.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ...errors import ConfigError, ModelError
from ..files import open_weights, read_weight
from ..golden import PROMPTS, GoldenSettings, record, write_golden
from ..staging import check_out, staged_head
from .format import SHARED, WHAT, config_json, expected_shapes, misfit, read_config

FORMATS = ("outrider", "vllm")
NO_GGUF = ("llama.cpp loads MTP (--spec-type draft-mtp) only as nextn layers of architectures whose graph builds "
           "them (deepseek2, glm4, glm4-moe, exaone4, qwen35, qwen3next, ...); its llama graph has none, so an MTP "
           "head for a Llama target has no GGUF llama.cpp loads (heads/mtp/export.py)")


def export_mtp(source: str | Path, out: str | Path, fmt: str, target: str | Path, *,
               settings: GoldenSettings = GoldenSettings(), prompts=PROMPTS, golden: bool = True, log=None) -> Path:
    from ...catalog.resolve import resolve_model
    from ...models.config import ModelConfig

    if fmt == "gguf":
        raise ConfigError(f"--format gguf: {NO_GGUF}")
    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt!r}: use one of {', '.join(FORMATS)}")
    out = check_out(out)
    target_path = resolve_model(target)
    tcfg = ModelConfig.load(target_path)
    config = read_config(source)
    reason = misfit(config, tcfg)
    if reason:
        raise ModelError(f"the head does not fit target {target}: {reason}")
    stored = open_weights(Path(source), what=WHAT)
    required, _ = expected_shapes(config)
    tensors = {name: read_weight(stored, Path(source), name).contiguous() for name in required}
    if fmt == "vllm":  # the target's embedding and lm_head, which vLLM loads per module
        from ...weights.loader import load_decoder

        t = load_decoder(target_path, torch.device("cpu"), torch.float32)
        p = f"model.layers.{config.num_target_layers}."
        tensors[p + SHARED[0]] = t.embed.contiguous()
        tensors[p + SHARED[1]] = t.lm_head.clone().contiguous()  # tied to the embedding in SmolLM2
    with staged_head(out, config_json(config), tensors) as work:
        if golden:
            if log:
                log(f"measuring the golden tau on {len(prompts)} prompts ({settings.device}, {settings.dtype})")
            from .golden import measure

            write_golden(work, record(measure(work, target_path, settings, prompts), str(target), Path(target_path),
                                      [tcfg.architecture]))
    return out
