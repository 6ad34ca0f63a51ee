"""Load a Hugging Face style folder (config.json + *.safetensors) into a `Decoder`.

Only safetensors are read (never pickles) and no code from the folder runs. Q/K/V and gate/up
projections are fused at load time so a layer does two matmuls fewer per token.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..errors import ModelError
from .config import ModelConfig
from .decoder import Decoder, LayerWeights


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    """fp32 on the CPU (bf16 matmuls are slow without AMX), bf16 on CUDA."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


class _Tensors:
    """Reads named tensors lazily from every *.safetensors file of a folder."""

    def __init__(self, folder: Path):
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ModelError(f"{folder}: no *.safetensors file; Outrider loads safetensors only (never pickles)")
        self.where: dict[str, Path] = {}
        self.handles = {}
        for path in files:
            try:
                handle = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError, ValueError) as err:
                raise ModelError(f"{path} is corrupt or truncated ({err}); re-pull or re-download it") from None
            self.handles[path] = handle
            for name in handle.keys():
                self.where[name] = path

    def has(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if name not in self.where:
            raise ModelError(f"weights are missing tensor '{name}'; the folder is incomplete or not this architecture")
        try:
            tensor = self.handles[self.where[name]].get_tensor(name)
        except (SafetensorError, OSError) as err:
            raise ModelError(f"{self.where[name]}: cannot read '{name}' ({err}); re-pull the model") from None
        return tensor.to(device=device, dtype=dtype)


def load_decoder(folder: str | Path, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> Decoder:
    folder = Path(folder)
    config = ModelConfig.load(folder)
    device = torch.device(device) if device is not None else default_device()
    dtype = dtype or default_dtype(device)
    weights = _Tensors(folder)
    get = lambda name: weights.get(name, dtype, device)  # noqa: E731
    embed = get("model.embed_tokens.weight")
    if embed.shape[0] != config.vocab_size:
        raise ModelError(f"{folder}: embedding has {embed.shape[0]} rows but vocab_size is {config.vocab_size}")
    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        qkv_bias = None
        if config.qkv_bias:
            qkv_bias = torch.cat([get(attn + f"{n}_proj.bias") for n in "qkv"])
        layers.append(LayerWeights(
            input_norm=get(p + "input_layernorm.weight"),
            qkv=torch.cat([get(attn + f"{n}_proj.weight") for n in "qkv"]),
            qkv_bias=qkv_bias,
            o=get(attn + "o_proj.weight"),
            q_norm=get(attn + "q_norm.weight") if config.qk_norm else None,
            k_norm=get(attn + "k_norm.weight") if config.qk_norm else None,
            post_norm=get(p + "post_attention_layernorm.weight"),
            gate_up=torch.cat([get(mlp + "gate_proj.weight"), get(mlp + "up_proj.weight")]),
            down=get(mlp + "down_proj.weight"),
        ))
    if weights.has("lm_head.weight") and not config.tie_word_embeddings:
        lm_head = get("lm_head.weight")
    else:
        lm_head = embed
    return Decoder(config, embed, layers, get("model.norm.weight"), lm_head)
