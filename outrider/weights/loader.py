"""Load a Hugging Face style folder (config.json + *.safetensors, or an imported GGUF's folder:
config.json + original.gguf) into a `Decoder`.

Only safetensors and GGUF are read (never pickles) and no code from the folder runs. Q/K/V and gate/up
projections are fused at load time so a layer does two matmuls fewer per token.
"""

from __future__ import annotations

import gc
import re
from functools import partial
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..errors import ConfigError, ModelError
from ..models.config import ModelConfig
from ..models.decoder import Decoder, LayerWeights
from ..models.delta_layer import DeltaWeights
from ..models.family import GATED_DELTA, LATENT
from ..catalog.marker import GGUF_NAME
from .latent_load import latent_layer
from .mlp_load import Source, mlp_weights
from .gguf_hybrid import A_NEG
from .quant_load import QUANT_DTYPES, RowStack


DEVICES = "cpu, cuda, cuda:N or mps"  # the forms `resolve_device` accepts


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_device(device: torch.device | str | None) -> torch.device:
    """The device to load on, checked before any weights are read.

    None: CUDA when available, else the CPU. Accepts "cpu", "cuda", "cuda:N", "mps" (or a
    torch.device of those types); anything else, or a device this machine or this PyTorch build
    lacks, is a one-line ConfigError.
    """
    if device is None:
        return default_device()
    if isinstance(device, torch.device):
        name = str(device)
    elif isinstance(device, str):
        name = device
    else:
        raise TypeError(f"device must be a string ({DEVICES}) or a torch.device, got {type(device).__name__}")
    match = re.fullmatch(r"(cpu|mps|cuda)(?::(\d+))?", name)
    if match is None or (match[1] != "cuda" and match[2] not in (None, "0")):
        raise ConfigError(f"unknown device '{name}': use {DEVICES}")
    kind, index = match[1], int(match[2] or 0)
    if kind == "cuda":
        _check_cuda(name, index)
    elif kind == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("device 'mps' is not available here (it needs Apple silicon and an MPS build of "
                          "PyTorch); use --device cpu")
    return torch.device(name)


def _check_cuda(name: str, index: int) -> None:
    if torch.version.cuda is None and torch.version.hip is None:
        raise ConfigError(f"device '{name}' needs a CUDA build of PyTorch, and this one "
                          f"({torch.__version__}) has none; use --device cpu or install a CUDA build of torch")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ConfigError(f"device '{name}': no CUDA GPU is visible (check the driver and "
                          "CUDA_VISIBLE_DEVICES); use --device cpu")
    if index >= count:
        raise ConfigError(f"device '{name}' does not exist: this machine has {count} CUDA GPU(s), "
                          f"cuda:0 to cuda:{count - 1}")


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

    def projection(self, names: list[str], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The weights `names` stacked along `out` (fused Q/K/V, gate/up)."""
        parts = [self.get(name, dtype, device) for name in names]
        return parts[0] if len(parts) == 1 else torch.cat(parts)


class _Reading:
    """A weight source that remembers what was read, so that a tensor the runtime does not read (a
    bias on o_proj, a norm after attention, an attention sink) refuses the model rather than being
    left out of its arithmetic."""

    def __init__(self, source):
        self.source = source
        self.read: set[str] = set()

    def has(self, name: str) -> bool:
        return self.source.has(name)

    def get(self, name: str, dtype: torch.dtype, device: torch.device):
        self.read.add(name)
        return self.source.get(name, dtype, device)

    def projection(self, names: list[str], dtype: torch.dtype, device: torch.device, **kwargs):
        self.read.update(names)
        return self.source.projection(names, dtype, device, **kwargs)

    def rows(self, name: str, index: torch.Tensor, dtype: torch.dtype, device: torch.device):
        """Rows `index` (long [n]) of one weight: a float tensor, or kept quantized (exact: a
        block is one row's)."""
        self.read.add(name)
        if hasattr(self.source, "_linear"):  # QuantTensors: blocks of the chosen rows
            return self.source.projection([name], dtype, device, rows=index)
        return self.source.get(name, dtype, device).index_select(0, index.to(device))

    def check_all_read(self, folder: Path, config: ModelConfig, tied: bool) -> None:
        names = tensor_names(self.source)
        spare = {"lm_head.weight"} if tied else set()  # a tied model's copy of its embedding
        # buffers, and a multi-token-prediction head beside the model (Qwen3.5, Qwen3-Next: `mtp.*`,
        # which transformers does not load either): neither is in the model's forward
        unread = sorted(n for n in names - self.read - spare
                        if not n.endswith("rotary_emb.inv_freq") and not n.startswith("mtp."))
        if unread:
            shown = ", ".join(unread[:3]) + (f" and {len(unread) - 3} more" if len(unread) > 3 else "")
            raise ModelError(f"{folder}: {config.architecture} keeps tensors this runtime does not read ({shown}); "
                             "they would change its output, so it is not supported yet")


class _Shapes:
    """A folder's safetensors as names and shapes only: meta tensors, no data read."""

    def __init__(self, folder: Path):
        self.floats = _Tensors(folder)

    def has(self, name: str) -> bool:
        return self.floats.has(name)

    def get(self, name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if not self.floats.has(name):
            raise ModelError(f"weights are missing tensor '{name}'; the folder is incomplete or not this architecture")
        shape = self.floats.handles[self.floats.where[name]].get_slice(name).get_shape()
        return torch.empty(shape, dtype=dtype, device="meta")

    def projection(self, names: list[str], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        parts = [self.get(name, dtype, device) for name in names]
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def tensor_names(source) -> set[str]:
    """Every tensor name a weight source holds (Hugging Face names)."""
    for attr in ("where", "tensors"):  # _Tensors; a GGUF's index
        if hasattr(source, attr):
            return set(getattr(source, attr))
    inner = getattr(source, "gguf", None) or getattr(source, "floats", None)  # QuantTensors, GGUFFloats
    return tensor_names(inner)


def _attention_layer(p: str, config: ModelConfig, get, proj, norm, rows, mlp: dict) -> LayerWeights:
    """An attention layer's weights under Hugging Face's names (Llama, Qwen2, Qwen3, Qwen3.5)."""
    attn = p + "self_attn."
    qkv_bias = torch.cat([get(attn + f"{n}_proj.bias") for n in "qkv"]) if config.qkv_bias else None
    gate = None
    if config.attn_output_gate:  # q_proj's rows hold each head's queries, then its gate: [H, 2, D]
        H, D = config.num_heads, config.head_dim
        order = torch.arange(H * 2 * D).view(H, 2, D)
        q = rows(attn + "q_proj.weight", order[:, 0].reshape(-1))  # [H D, E]
        gate = rows(attn + "q_proj.weight", order[:, 1].reshape(-1))
        kv = proj(attn + "k_proj.weight", attn + "v_proj.weight")
        qkv = torch.cat((q, kv)) if isinstance(q, torch.Tensor) else RowStack([q, kv])
    else:
        qkv = proj(*[attn + f"{n}_proj.weight" for n in "qkv"])
    return LayerWeights(
        input_norm=norm(p + "input_layernorm.weight"), qkv=qkv, qkv_bias=qkv_bias, o=proj(attn + "o_proj.weight"),
        q_norm=norm(attn + "q_norm.weight") if config.qk_norm else None,
        k_norm=norm(attn + "k_norm.weight") if config.qk_norm else None,
        post_norm=norm(p + "post_attention_layernorm.weight"), gate=gate, **mlp)


def _delta_layer(p: str, config: ModelConfig, get, proj, norm, rows, mlp: dict, has=lambda name: False) -> LayerWeights:
    """A gated-delta layer's weights (Qwen3.5's and Qwen3-Next's `linear_attn`)."""
    lin = p + "linear_attn."
    if config.delta.grouped and not has(lin + "in_proj_qkv.weight"):  # a GGUF keeps q k v and z split (gguf_hybrid.py)
        in_proj = _grouped_in_proj(lin, config.delta, rows)
    else:
        in_proj = proj(*[lin + f"in_proj_{n}.weight" for n in ("qkv", "z", "b", "a")])
    delta = DeltaWeights(
        in_proj=in_proj,
        conv=get(lin + "conv1d.weight").squeeze(1).contiguous(),  # [C, K]
        a_neg=get(p + A_NEG).float() if has(p + A_NEG) else -get(lin + "A_log").float().exp(),  # a GGUF keeps it
        dt_bias=get(lin + "dt_bias").float(),
        norm=get(lin + "norm.weight"), out=proj(lin + "out_proj.weight"))
    return LayerWeights(
        input_norm=norm(p + "input_layernorm.weight"), qkv=None, qkv_bias=None, o=None, q_norm=None, k_norm=None,
        post_norm=norm(p + "post_attention_layernorm.weight"), delta=delta, **mlp)


def _grouped_in_proj(lin: str, d, rows):
    """Qwen3-Next's in_proj_qkvz [HK (2 dk + 2 r dv), E] and in_proj_ba [HK 2r, E] (r = HV / HK value
    heads a key head; per key head h: its q, k, then its r value heads' v and z; their b, then a;
    value head h r + j) reordered into the gated-delta mixer's in_proj: q k v (all heads), z, b, a."""
    HK, dk, dv, r = d.num_k_heads, d.k_head_dim, d.v_head_dim, d.num_v_heads // d.num_k_heads
    qkvz = torch.arange(HK * (2 * dk + 2 * r * dv)).view(HK, -1)  # [HK, 2 dk + 2 r dv] row numbers
    ba = torch.arange(HK * 2 * r).view(HK, 2 * r)
    cuts = [0, dk, 2 * dk, 2 * dk + r * dv, 2 * dk + 2 * r * dv]
    order = torch.cat([qkvz[:, a:b].reshape(-1) for a, b in zip(cuts, cuts[1:])])  # q, k, v, z
    first = rows(lin + "in_proj_qkvz.weight", order)  # [C + HV dv, E]
    second = rows(lin + "in_proj_ba.weight", torch.cat((ba[:, :r].reshape(-1), ba[:, r:].reshape(-1))))  # [2 HV, E]
    return torch.cat((first, second)) if isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor) \
        else RowStack([first, second])


def open_weights(folder: Path, shapes_only: bool = False):
    """A folder's float weights: its safetensors, or, where it keeps only a GGUF (an imported
    one, catalog/imported.py), the GGUF's tensors dequantized at load (quant_load.GGUFFloats).
    shapes_only: names and shapes, no data (_Shapes, quant_load.GGUFShapes)."""
    if not any(folder.glob("*.safetensors")) and (folder / GGUF_NAME).is_file():
        from .quant_load import GGUFFloats, GGUFShapes

        return (GGUFShapes if shapes_only else GGUFFloats)(folder / GGUF_NAME)
    return _Shapes(folder) if shapes_only else _Tensors(folder)


def norms_folded(source) -> bool:
    """Whether `source` keeps the (1 + w) RMS norms with the 1 already added (a hybrid's GGUF, as
    llama.cpp's converter writes it: gguf_hybrid.py), so the loader takes them as they are."""
    return bool(getattr(getattr(source, "source", source), "norms_folded", False))


DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
               "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
               **{name: name for name in QUANT_DTYPES}}


def parse_dtype(name: str | None) -> torch.dtype | str | None:
    """`--dtype`: a float dtype, or "q8_0" / "q4" (and their -bf16-lossy forms): weights kept
    quantized (weights/quant_load.py); None: the device's default."""
    if name is None:
        return None
    if name not in DTYPE_NAMES:
        raise ConfigError(f"unknown dtype '{name}': use float32, bfloat16, float16, {', '.join(QUANT_DTYPES)}")
    return DTYPE_NAMES[name]


KV_DTYPES = {"float32": torch.float32, "float16": torch.float16}  # --kv-dtype names


def parse_kv_dtype(name: str | None) -> torch.dtype | None:
    """`--kv-dtype`: the K/V cache's values, float32 or float16 (half the bytes attention reads:
    llama.cpp's default cache type; a model of its own, exact under speculation like every dtype
    here); None: the compute dtype."""
    if name is None:
        return None
    if name not in KV_DTYPES:
        raise ConfigError(f"unknown --kv-dtype '{name}': use {' or '.join(KV_DTYPES)}")
    return KV_DTYPES[name]


def auto_dtype(folder: str | Path, device: torch.device | str | None = None) -> str | None:
    """The dtype a model runs in when none is asked for (`LLM`, the CLI, the bench): on a CPU where
    Outrider's quantized kernel builds (kernels/native.py), a GGUF-sourced model's own quantization
    ("q4" for the packaged SmolLM2's Q4_1, "gguf" for a file of mixed or K-quant kinds such as the
    packaged Qwens'): the same weights as the float32 folder converted from that GGUF, computed in
    float32 in another summation order, at about twice the speed and a third to a fifth of the
    memory. Otherwise None: the device's float default (float32 on a CPU)."""
    from ..kernels import native
    from .quant_load import own_quantization

    if resolve_device(device).type != "cpu" or not native.available():
        return None
    return own_quantization(folder)


def load_decoder(folder: str | Path, device: torch.device | str | None = None,
                 dtype: torch.dtype | str | None = None, head_ids: torch.Tensor | None = None, *,
                 kv_dtype: torch.dtype | None = None, drafter: bool = False, shapes_only: bool = False) -> Decoder:
    """dtype: a float dtype, or "q8_0" / "q4" / "gguf" (and the -bf16-lossy forms) for weights kept
    quantized (see weights/quant_load.py); None: the device's float default (callers wanting the model's
    own quantization pass `auto_dtype(folder, device)`). head_ids: long [n], sorted token ids:
    the output head keeps only their rows (a drafter's reduced vocabulary: logits column i is
    token head_ids[i]; `Decoder.head_ids`). kv_dtype: the K/V cache's values (None: the compute
    dtype); drafter: a draft model (its prompt may be multiplied in bfloat16, dispatch.py). Each is
    fixed for the model's life. shapes_only: read no weight, only names and shapes (every check of
    the load, on the meta device: `outrider models check`)."""
    folder = Path(folder)
    config = ModelConfig.load(folder)
    device = torch.device("meta") if shapes_only else resolve_device(device)
    quantized = dtype if isinstance(dtype, str) else None
    dtype = torch.float32 if shapes_only else default_dtype(device) if quantized or dtype is None else dtype
    weights = open_weights(folder, shapes_only)
    vision_source = None
    if config.vision is not None:  # a vision-language model: its text model's tensors (vision_load.py)
        from .vision_load import TextPart

        if quantized:
            raise ModelError(f"{folder}: --dtype {quantized} is not supported yet for a vision-language model "
                             f"({config.architecture}); use --dtype float32, bfloat16 or float16")
        vision_source, weights = weights, TextPart(weights, tensor_names(weights))
    if quantized:
        from .quant_load import QuantTensors

        weights = QuantTensors(folder, quantized, weights)
    weights = _Reading(weights)
    get = lambda name: weights.get(name, dtype, device)  # noqa: E731
    proj = lambda *names: weights.projection(list(names), dtype, device)  # noqa: E731
    embed = get("model.embed_tokens.weight")
    if embed.shape[0] != config.vocab_size:
        raise ModelError(f"{folder}: embedding has {embed.shape[0]} rows but vocab_size is {config.vocab_size}")
    if quantized and config.layer_kinds and quantized.endswith("-bf16-lossy"):
        raise ModelError(f"{folder}: --dtype {quantized} is not supported yet for {config.architecture}; "
                         "use --dtype float32, q8_0, q4 or (a GGUF's own blocks) gguf")
    folded = config.norm_plus_one and not norms_folded(weights)  # a hybrid's GGUF keeps them folded
    norm = (lambda name: get(name) + 1) if folded else get  # (1 + w) norms, folded once
    rows = lambda name, index: weights.rows(name, index, dtype, device)  # noqa: E731
    source = Source(get, proj, weights.has, quantized, lambda name: weights.get(name, torch.float32, device))
    delta_layer = partial(_delta_layer, has=weights.has)  # has: a GGUF keeps -exp(A_log) (gguf_hybrid.py)
    kinds = {GATED_DELTA: delta_layer, LATENT: partial(latent_layer, has=weights.has)}  # else attention
    layers = [kinds.get(config.kind(i), _attention_layer)(
              f"model.layers.{i}.", config, get, proj, norm, rows,
              mlp_weights(f"model.layers.{i}.mlp.", config.mlp_kind(i), config, source))
              for i in range(config.num_layers)]
    head = "lm_head.weight" if weights.has("lm_head.weight") and not config.tie_word_embeddings else None
    if config.sandwich_norms:  # Gemma 3: post_attention_layernorm is the attention output's norm (sandwich_layer.py)
        layers = [replace(w, attn_out_norm=w.post_norm, post_norm=norm(f"model.layers.{i}.pre_feedforward_layernorm.weight"),
                          mlp_out_norm=norm(f"model.layers.{i}.post_feedforward_layernorm.weight"))
                  for i, w in enumerate(layers)]
    if head_ids is not None:
        if head_ids.numel() == 0 or int(head_ids.min()) < 0 or int(head_ids.max()) >= config.vocab_size:
            raise ModelError(f"{folder}: head_ids must be token ids in 0..{config.vocab_size - 1}")
        if quantized:
            lm_head = weights.projection([head or "model.embed_tokens.weight"], dtype, device, rows=head_ids)
        else:  # tied: the rows of the table already loaded
            full = weights.get(head, dtype, device) if head else embed
            lm_head = full.index_select(0, head_ids.to(device))
    elif head:
        lm_head = proj(head)
    else:
        lm_head = embed if not quantized else proj("model.embed_tokens.weight")  # tied: the same blocks
    final_norm = norm("model.norm.weight")
    weights.check_all_read(folder, config, tied=head is None)
    decoder = Decoder(config, embed, layers, final_norm, lm_head, quantization=quantized, head_ids=head_ids,
                      kv_dtype=kv_dtype, drafter=drafter)
    if vision_source is not None:  # its image side (models/vision_encoder.py), run once a prompt
        from .vision_load import load_vision

        decoder.vision = load_vision(vision_source, tensor_names(vision_source), config.vision, dtype, device, folder)
    if quantized or not isinstance(weights, _Tensors):
        del weights, get, proj
        gc.collect()  # the GGUF reader's objects hold its memory map in cycles: unmap it now, not at some later collection
    return decoder
