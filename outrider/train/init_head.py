"""`--init-from HEAD`: a training run that starts from an exported head's weights and draft vocabulary."""

from __future__ import annotations

import torch

from ..errors import ConfigError


def init_head(name: str, target, kind: str = "eagle3") -> tuple[dict[str, torch.Tensor], list[int] | None]:
    """--init-from: (the head's tensors under the EAGLE names, float32; its layer ids in vLLM's
    convention), after checking that it fits `target` and that this trainer can continue it.
    kind "dflash": a DFlash head's tensors (z-lab's names, float32) and None (the job reads its
    taps from its config)."""
    from safetensors.torch import load_file

    if kind == "dflash":
        return _dflash(name, target), None

    from ..heads.catalog import resolve_head
    from ..heads.files import WEIGHTS
    from ..heads.eagle3.format import layer_prefix, misfit, read_config

    folder = resolve_head(name)
    config = read_config(folder)
    tensors = load_file(str(folder / WEIGHTS))
    reason = misfit(config, target.config, "embed_tokens.weight" in tensors, "lm_head.weight" in tensors)
    if reason:
        raise ConfigError(f"--init-from {name}: {reason}")
    if config.norm_before_residual or config.hidden_size != target.config.hidden_size:
        raise ConfigError(f"--init-from {name}: this trainer continues heads of the target's hidden size with "
                          "norm_before_residual false; train a new head instead")
    prefix = layer_prefix(set(tensors))
    renamed = {("midlayer." + k[len(prefix):] if k.startswith(prefix) else k): v for k, v in tensors.items()}
    out = {k: v.float() if v.is_floating_point() else v for k, v in renamed.items()}
    return out, list(config.taps(target.config.num_layers))


def _dflash(name: str, target) -> dict[str, torch.Tensor]:
    """A DFlash head's weights to continue (AdaFlash's OPD and length head start from one)."""
    from safetensors.torch import load_file

    from ..heads.catalog import resolve_head
    from ..heads.dflash.format import misfit, read_config
    from ..heads.files import WEIGHTS

    folder = resolve_head(name, kind="dflash")
    reason = misfit(read_config(folder), target.config)
    if reason:
        raise ConfigError(f"--init-from {name}: {reason}")
    tensors = load_file(str(folder / WEIGHTS))
    return {k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}
