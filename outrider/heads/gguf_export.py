"""Write an EAGLE-3 or DFlash head as the GGUF file llama.cpp's llama-server drafts with, and read one back.

    export_gguf("eagle3", "outrider/heads/shipped/eagle3/smollm2-135m-instruct", "out/eagle3.gguf",
                "smollm2-135m-instruct")
    llama-server -m TARGET.gguf -md out/eagle3.gguf --spec-type draft-eagle3 --spec-draft-n-max 4 --spec-draft-p-min 0

The layout (names, keys, the q/k RoPE permutation, absolute d2t) is heads/gguf_layout.py's and each
kind's (heads/<kind>/gguf.py, named in heads/kinds.py), read from llama.cpp's loader. Matrices keep
the head's dtype (or `dtype`): F32, F16 or BF16 (BF16 words written as they are); one-dimensional
tensors (norms) are written F32, as llama.cpp's converters do, which holds any bf16/fp16 value
exactly. The draft GGUF carries the target GGUF's tokenizer (every
`tokenizer.*` key: llama-server checks the two vocabularies agree and DFlash reads its mask id from
the draft's), from the target's `original.gguf` (catalog models keep one) or `target_gguf`.
No golden is written: a GGUF head is checked by running it (scripts/llamacpp_head_check.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from ..errors import ConfigError, ModelError
from . import gguf_layout as layout

GGUF_TYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def check_out_file(out: str | Path) -> Path:
    """`out` as a Path to a new .gguf file, refused in one line otherwise."""
    out = Path(out)
    if out.suffix != ".gguf":
        raise ConfigError(f"--out {out}: with --format gguf give the path of the .gguf file to write")
    if out.exists():
        raise ConfigError(f"--out {out} already exists; give a new file name")
    return out


def target_gguf_of(target_path: Path, given: str | Path | None) -> Path:
    path = Path(given) if given else Path(target_path) / "original.gguf"
    if not path.is_file():
        raise ConfigError(f"no target GGUF at {path} (its tokenizer goes into the draft): pass --target-gguf FILE")
    return path


def head_tensors(kind: str, source: str | Path, target_config, dtype: torch.dtype | None = None):
    """(config, {our name: tensor}) of the head in folder `source` as llama.cpp takes them: every
    tensor the config implies, checked against it (the kind's heads/<kind>/gguf.py); d2t as
    absolute target ids; t2d left out."""
    config, tensors = layout.gguf_of(kind).head_tensors(source, target_config, dtype)
    tensors.pop("t2d", None)
    if "d2t" in tensors:
        d2t = tensors["d2t"].to(torch.int64)  # [Vd]: target id = d + d2t[d]
        tensors["d2t"] = d2t + torch.arange(d2t.numel())
    return config, tensors


def metadata(kind: str, config, target_config) -> dict:
    """The arch's keys (without the `ARCH.` prefix) with their values: every kind's, then its own."""
    c, g = config, layout.gguf_of(kind)
    taps = list(c.taps(target_config.num_layers))  # Hugging Face hidden_states ids = llama.cpp's layer inputs
    keys = {"context_length": target_config.max_position_embeddings, "embedding_length": c.hidden_size,
            "block_count": g.num_layers(c), "feed_forward_length": c.intermediate_size,
            "attention.head_count": c.num_heads, "attention.head_count_kv": c.num_kv_heads,
            "attention.key_length": c.head_dim, "attention.value_length": c.head_dim,
            "rope.freq_base": float(c.rope_theta), "rope.dimension_count": c.head_dim,
            "attention.layer_norm_rms_epsilon": float(c.rms_norm_eps), "vocab_size": c.vocab_size,
            "target_layers": taps}
    keys.update(g.metadata(c))
    return keys


def export_gguf(kind: str, source: str | Path, out: str | Path, target: str | Path, *, dtype: str | None = None,
                target_gguf: str | Path | None = None, log=None) -> Path:
    """Write the `kind` ("eagle3" or "dflash") head in folder `source`, made for `target` (catalog
    name or folder), as the GGUF file `out`; returns `out`."""
    import gguf

    from ..catalog.resolve import resolve_model
    from ..models.config import ModelConfig
    from .staging import DTYPES

    g = layout.gguf_of(kind)  # a one-line refusal for a kind llama.cpp does not load
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: use bf16, fp16 or fp32 (or leave it out to keep the head's)")
    out = check_out_file(out)
    target_path = resolve_model(target)
    tcfg = ModelConfig.load(target_path)
    tokenizer_from = target_gguf_of(target_path, target_gguf)
    config, tensors = head_tensors(kind, source, tcfg, DTYPES[dtype] if dtype else None)
    arch = g.ARCH
    keys = metadata(kind, config, tcfg)
    check_loadable(kind, config, tensors, keys)
    writer = gguf.GGUFWriter(None, arch)
    writer.add_name(f"{Path(source).name} ({kind} draft for {target})")
    for key, value in keys.items():
        full = f"{arch}.{key}"
        if isinstance(value, list):
            writer.add_array(full, value)
        elif isinstance(value, bool):
            writer.add_bool(full, value)
        elif isinstance(value, float):
            writer.add_float32(full, value)
        else:
            writer.add_uint32(full, int(value))
    copy_tokenizer(writer, tokenizer_from)
    g.extra(writer, config)  # DFlash: its mask token
    for name, t in tensors.items():
        heads = layout.permuted_heads(kind, name, config.num_heads, config.num_kv_heads)
        if heads is not None:
            t = layout.rope_permute(t, heads)
        _add_tensor(writer, layout.gguf_name(kind, name), t)
    partial = out.with_name(out.name + ".partial")
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        writer.write_header_to_file(partial)
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)
    if log:
        log(f"{len(tensors)} tensors, tokenizer from {tokenizer_from}")
    return out


def check_loadable(kind: str, config, tensors: dict, keys: dict) -> None:
    """ModelError unless every tensor and key the loader requires (gguf_layout) is about to be written
    with the shape it asks for: a guard between the head's config and llama.cpp's create_tensor calls."""
    written = {layout.gguf_name(kind, n): tuple(t.shape) for n, t in tensors.items()}
    g = layout.gguf_of(kind)
    need = layout.required_tensors(kind, config.hidden_size, tensors["fc.weight"].shape[1], config.num_heads,
                                   config.num_kv_heads, config.head_dim, config.intermediate_size, g.num_layers(config))
    wrong = [n for n, shape in need.items() if written.get(n) != shape]
    wrong += [k for k in g.REQUIRED_KEYS if k not in keys]
    if wrong:
        raise ModelError(f"the {kind} head would not load in llama.cpp: {', '.join(wrong)} missing or misshapen")


def _add_tensor(writer, name: str, t: torch.Tensor) -> None:
    import gguf

    t = t.detach().cpu().contiguous()
    if t.dtype == torch.int64:
        writer.add_tensor(name, t.numpy(), raw_dtype=gguf.GGMLQuantizationType.I64)
    elif t.dim() == 1:
        writer.add_tensor(name, t.to(torch.float32).numpy())
    elif t.dtype == torch.bfloat16:
        writer.add_tensor(name, t.view(torch.int16).numpy().view(np.uint16), raw_dtype=gguf.GGMLQuantizationType.BF16)
    elif t.dtype in (torch.float16, torch.float32):
        writer.add_tensor(name, t.numpy())
    else:
        raise ModelError(f"tensor {name} has dtype {t.dtype}; GGUF export writes float32, float16 or bfloat16")


def copy_tokenizer(writer, source: Path) -> None:
    """Every `tokenizer.*` key of the GGUF file `source`, as it is there."""
    import gguf

    reader = gguf.GGUFReader(source)
    found = False
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        found = True
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub)
    if not found:
        raise ModelError(f"{source} has no tokenizer.* keys; give the target's own GGUF with --target-gguf")


def read_gguf(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(metadata {key: value}, {llama.cpp name: tensor as stored}) of a GGUF file; BF16 as bfloat16."""
    import gguf

    reader = gguf.GGUFReader(path)
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    tensors = {}
    for t in reader.tensors:
        data = np.array(t.data)
        if t.tensor_type == gguf.GGMLQuantizationType.BF16:
            words = data.view(np.int16).reshape(tuple(reversed(t.shape.tolist())))
            tensors[t.name] = torch.from_numpy(words.copy()).view(torch.bfloat16)
        else:
            tensors[t.name] = torch.from_numpy(data.copy())
    return meta, tensors


def ours_from_gguf(kind: str, path: str | Path, config, names) -> dict[str, torch.Tensor]:
    """Our tensors `names` back from the GGUF at `path`: un-permuted, d2t as offsets again, each in
    the dtype `names[name]` gives (the head's): what the file holds, undone."""
    _, stored = read_gguf(path)
    out = {}
    for name, dtype in names.items():
        t = stored[layout.gguf_name(kind, name)]
        heads = layout.permuted_heads(kind, name, config.num_heads, config.num_kv_heads)
        if heads is not None:
            t = layout.rope_unpermute(t, heads)
        if name == "d2t":
            t = t - torch.arange(t.numel())
        out[name] = t.to(dtype)
    return out
