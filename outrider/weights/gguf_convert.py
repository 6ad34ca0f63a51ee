"""Convert a GGUF file (llama, qwen2, qwen3; qwen35's, qwen3next's and the mixtures of experts'
metadata: qwen3moe, olmoe, llama with experts, deepseek2) into a Hugging Face style folder.

    convert_gguf("SmolLM2.Q4_1.gguf", "out/")   # -> out/config.json, model.safetensors,
                                                 #    tokenizer.json, tokenizer_config.json,
                                                 #    chat_template.jinja, generation_config.json

Every tensor is dequantized to float32 with the `gguf` library and written under its Hugging Face
name (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`), one tensor at a time
straight into the safetensors file, so peak memory is about one dequantized tensor (the embedding)
plus the file's memory map, whatever the model's size.

Two things llama.cpp's converter changes that we undo or recover (and Gemma 3's own: gguf_gemma3.py):
- for the llama architecture it permutes the rows of the Q and K projections from the
  "rotate half" rotary layout (Hugging Face) to the interleaved-pairs layout (llama.cpp); see
  `unpermute_rotary_rows`. qwen2 and qwen3 are written unpermuted.
- for the qwen35 and qwen3next gated-delta hybrids it renames, reorders, splits, stacks and folds
  more (gguf_hybrid.py); such a file is read in place (an imported folder), its weights not written out here.
- the mixtures of experts (Qwen3-MoE, OLMoE, Mixtral as a llama with experts) stack each layer's
  experts into 3-D tensors (gguf_moe.py); read in place too. So is DeepSeek-V2 / V3 (`deepseek2`:
  latent attention, kv_b_proj kept whole or split in two, its own metadata: gguf_deepseek.py).
- Llama 3's RoPE scaling: the converter writes no `rope.scaling` fields for it but a `rope_freqs`
  tensor, one divisor a rotating pair (llama.cpp divides each inverse frequency by it). Its values
  go into config.json as rope_parameters {"rope_type": "freq_factors", "freq_factors": [...]}
  (models/rope.py), not into the weights (`CONFIG_TENSORS`).
- the end-of-generation tokens: the GGUF names one `eos_token_id`, but a chat model stops on its
  end-of-turn token too. `generation_config.json` lists all of them (see `end_of_generation_ids`).

The tokenizer is converted by transformers' GGUF tokenizer reader, then saved as a fast tokenizer;
the chat template is kept both in `chat_template.jinja` and in `tokenizer_config.json`.
Nothing from the GGUF is executed; the chat template is only rendered in transformers' sandbox.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Callable

import numpy as np

from . import gguf_gemma3
from ..errors import ModelError
from . import gguf_deepseek, gguf_hybrid, gguf_moe

GGUF_NAME = "original.gguf"  # the GGUF a model folder keeps beside its converted files

# gguf architecture -> (Hugging Face model_type, model class, Q/K rows permuted by llama.cpp)
ARCHITECTURES = {
    gguf_gemma3.ARCH: (*gguf_gemma3.MODEL, False),
    "llama": ("llama", "LlamaForCausalLM", True),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", False),
    "qwen3": ("qwen3", "Qwen3ForCausalLM", False),
    **{arch: (*model, False) for arch, model in gguf_moe.ARCHS.items()},  # (a llama with experts: Mixtral)
    gguf_hybrid.ARCH: (*gguf_hybrid.MODEL, False),
    gguf_hybrid.NEXT: (*gguf_hybrid.MODELS[gguf_hybrid.NEXT], False),
    gguf_deepseek.ARCH: (*gguf_deepseek.MODELS[2], False),  # or V3, by its gating function (gguf_deepseek.py)
}

_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# tensors whose values go into config.json, not the weights (hf_config's rope_factors)
CONFIG_TENSORS = frozenset({"rope_freqs.weight"})
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

# Token texts that end generation wherever they are control tokens (llama.cpp stops on these too).
_END_TEXTS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end|>",
              "<end_of_turn>", "<|end_of_text|>", "<EOT>")
_CONTROL, _USER_DEFINED = 3, 4  # gguf.TokenType values


def hf_tensor_name(gguf_name: str, arch: str | None = None) -> str:
    """`blk.3.attn_q.bias` -> `model.layers.3.self_attn.q_proj.bias`; unknown names raise ModelError."""
    hybrid = gguf_hybrid.hf_name(gguf_name)
    if hybrid is not None:
        return hybrid
    if arch == gguf_deepseek.ARCH and gguf_deepseek.hf_name(gguf_name):  # its latent attention's and experts' names
        return gguf_deepseek.hf_name(gguf_name)
    if arch == gguf_gemma3.ARCH and gguf_gemma3.hf_name(gguf_name):  # its sandwich norms' names
        return gguf_gemma3.hf_name(gguf_name)
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_TENSORS and suffix == "weight":
        return f"{_GLOBAL_TENSORS[base]}.weight"
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_TENSORS:
        layer, kind, suffix = match.groups()
        return f"model.layers.{layer}.{_LAYER_TENSORS[kind]}.{suffix}"
    raise ModelError(f"GGUF tensor '{gguf_name}' has no Hugging Face equivalent here; "
                     "this variant of the architecture is not supported yet")


def unpermute_rotary_rows(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation of a llama Q or K projection (weight or bias).

    Hugging Face orders each head's rows as two halves, [x_0 .. x_{d/2-1}, y_0 .. y_{d/2-1}]
    (rotate_half pairs row i with row i + d/2); llama.cpp interleaves the pairs, [x_0, y_0, x_1,
    y_1, ...]. Worked example, one head, d = 4: llama.cpp rows [x0, y0, x1, y1] -> [x0, x1, y0, y1].
    `num_heads` is the number of heads this projection produces (the KV heads for K).
    """
    # rows: [num_heads * head_dim, ...]
    head_dim = rows.shape[0] // num_heads
    pairs = rows.reshape(num_heads, head_dim // 2, 2, *rows.shape[1:])  # [heads, d/2, 2, ...]
    return pairs.swapaxes(1, 2).reshape(rows.shape)                     # [heads, 2, d/2, ...]


def read_metadata(reader) -> dict:
    """Every key-value field of a `gguf.GGUFReader`, as Python values (token arrays included)."""
    return {key: field.contents() for key, field in reader.fields.items()}


def hf_config(meta: dict, tensors: dict[str, tuple[int, ...]], rope_factors: list[float] | None = None) -> dict:
    """The `config.json` dict for a GGUF's metadata and its tensor shapes (gguf name -> HF shape);
    rope_factors: the values of its `rope_freqs` tensor, where it has one."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelError(f"GGUF architecture '{arch}' is not supported; supported: {', '.join(ARCHITECTURES)}")
    if arch == gguf_deepseek.ARCH:  # latent attention and DeepSeek's experts: a config of its own
        return gguf_deepseek.config(meta, tensors, common_fields(meta, arch))
    model_type, model_class, _ = ARCHITECTURES[arch]
    moe = gguf_moe.is_moe(meta)
    if moe:
        model_type, model_class = gguf_moe.model(meta)
    key = lambda name, default=None: meta.get(f"{arch}.{name}", default)  # noqa: E731
    scaling = key("rope.scaling.type")
    if scaling not in (None, "none"):
        raise ModelError(f"GGUF rope scaling '{scaling}' is not supported yet; use a model without it")
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    kv_heads = int(key("attention.head_count_kv", heads))
    head_dim = int(key("attention.key_length", hidden // heads))
    hybrid = arch in gguf_hybrid.MODELS
    first_q = next((n for n in tensors if n.startswith("blk.") and n.endswith(".attn_q.weight")), None)
    q_rows = tensors[first_q][0] if first_q else None
    q_per_head = 2 * head_dim if hybrid else head_dim  # a hybrid's q_proj: each head's queries, then its gate
    if q_rows != heads * q_per_head or (int(key("rope.dimension_count", head_dim)) != head_dim and not hybrid):
        raise ModelError(f"GGUF shapes disagree with its metadata (q rows {q_rows}, {heads} heads of "
                         f"{head_dim}) or use partial rotary; this file is not supported")
    tied = "output.weight" not in tensors
    theta = _decimal(key("rope.freq_base", 10000.0))
    config = {
        "architectures": [model_class],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": tensors["token_embd.weight"][0],
        "tie_word_embeddings": tied,
        **common_fields(meta, arch),
    }
    if arch == gguf_gemma3.ARCH:  # its own fields, and a RoPE per layer type (gguf_gemma3.py)
        fields = gguf_gemma3.config_fields(meta, hidden, heads, head_dim, int(key("block_count")))
        local = fields.pop("local_rope_theta")
        config.pop("hidden_act")
        config.update(fields, rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": local},
                                               "full_attention": {"rope_type": "default", "rope_theta": theta}})
    if arch == "llama":
        config.update(attention_bias="blk.0.attn_q.bias" in tensors, mlp_bias=False)
    if arch in ("qwen2", "qwen3"):
        config.update(use_sliding_window=False, sliding_window=None)
    if moe:
        config.update(gguf_moe.config_fields(meta, tensors))
    if arch == "qwen3":
        config.update(attention_bias="blk.0.attn_q.bias" in tensors)
    if "rope_freqs.weight" in tensors:  # Llama 3's scaling as llama.cpp's converter writes it
        if arch not in ("llama", "qwen2", "qwen3") or rope_factors is None or len(rope_factors) != head_dim // 2:
            raise ModelError(f"GGUF rope_freqs ({len(rope_factors or ())} factors) is not supported for {arch} "
                             f"with head_dim {head_dim} (llama, qwen2, qwen3: head_dim / 2 factors)")
        config["rope_parameters"] = {"rope_type": "freq_factors", "rope_theta": theta,
                                     "freq_factors": [float(f) for f in rope_factors]}
    if hybrid:
        fields = gguf_hybrid.config_fields(meta, head_dim, tensors)
        config["rope_parameters"]["partial_rotary_factor"] = fields.pop("partial_rotary_factor")
        config.update(fields)
    return config


def common_fields(meta: dict, arch: str) -> dict:
    """What every converted config.json reads alike from a GGUF: SiLU, the RMS epsilon, plain RoPE
    of rope.freq_base, the context, the token ids from the tokenizer fields, and the inert fields
    (no dropout, the cache on, float32)."""
    key = lambda name, default=None: meta.get(f"{arch}.{name}", default)  # noqa: E731
    theta = _decimal(key("rope.freq_base", 10000.0))
    return {"hidden_act": "silu", "rms_norm_eps": _decimal(key("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": theta, "rope_scaling": None, "rope_parameters": {"rope_type": "default", "rope_theta": theta},
            "max_position_embeddings": int(key("context_length", 2048)),
            "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
            "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
            "attention_dropout": 0.0, "use_cache": True, "torch_dtype": "float32", "dtype": "float32"}


def _decimal(value: float) -> float:
    """The shortest decimal that rounds to the same float32 (GGUF stores 1e-5 as 9.99999974e-06)."""
    return float(str(np.float32(value)))


def _float32_rows(tensor) -> np.ndarray:
    """Dequantize one `ReaderTensor` to float32 in Hugging Face shape [rows, cols] (or [n])."""
    from gguf.quants import dequantize

    shape = tuple(int(n) for n in reversed(tensor.shape))  # gguf lists the fastest dimension first
    values = dequantize(tensor.data, tensor.tensor_type)
    return np.asarray(values, dtype=np.float32).reshape(shape)


def _safetensors_header(entries: list[tuple[str, tuple[int, ...]]]) -> bytes:
    """Length-prefixed JSON header for float32 tensors laid out back to back in `entries` order."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in entries:
        size = 4 * int(np.prod(shape, dtype=np.int64))
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text


def write_weights(reader, path: Path, rotary_heads: dict[str, int],
                  log: Callable[[str], None] = print) -> None:
    """Stream every tensor of `reader` into one float32 safetensors file at `path`.

    `rotary_heads` ({"attn_q": heads, "attn_k": kv_heads}, or empty) names the projections whose
    rows llama.cpp permuted, and their head counts.
    """
    arch = str(reader.fields["general.architecture"].contents())
    plan = [(t, hf_tensor_name(t.name, arch), tuple(int(n) for n in reversed(t.shape))) for t in reader.tensors
            if t.name not in CONFIG_TENSORS]
    with open(path, "wb") as out:
        out.write(_safetensors_header([(name, shape) for _, name, shape in plan]))
        for i, (tensor, name, shape) in enumerate(plan):
            rows = _float32_rows(tensor)
            kind = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else ""
            if kind in rotary_heads:
                rows = unpermute_rotary_rows(rows, rotary_heads[kind])
            if arch == gguf_gemma3.ARCH:
                rows = gguf_gemma3.undo_float(name, rows)
            out.write(np.ascontiguousarray(rows).data)
            if (i + 1) % 50 == 0 or i + 1 == len(plan):
                log(f"  {i + 1}/{len(plan)} tensors")


def end_of_generation_ids(meta: dict, template_end: str | None = None) -> list[int]:
    """All token ids that end generation: the GGUF's eos (and eot/eom when it names them), the
    chat template's end-of-turn token, and any control token with a well-known end text."""
    tokens = meta.get("tokenizer.ggml.tokens") or []
    types = meta.get("tokenizer.ggml.token_type") or [_CONTROL] * len(tokens)
    ids = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    ends = set(_END_TEXTS) | ({template_end} if template_end else set())
    ids += [i for i, text in enumerate(tokens)
            if text in ends and (types[i] in (_CONTROL, _USER_DEFINED) or text == template_end)]
    found = []
    for i in ids:
        if i is not None and i not in found:
            found.append(int(i))
    return found


def template_end_token(tokenizer) -> str | None:
    """The special token the chat template writes right after an assistant message, if any."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    marker = "\u2063answer\u2063"
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "question"}, {"role": "assistant", "content": marker}],
            tokenize=False)
    except Exception:  # a template that refuses this conversation: fall back to the metadata
        return None
    tail = text.split(marker, 1)[-1].lstrip()
    specials = sorted(tokenizer.all_special_tokens + list(tokenizer.get_added_vocab()), key=len, reverse=True)
    return next((s for s in specials if s and tail.startswith(s)), None)


def write_tokenizer(gguf_path: Path, out_dir: Path, meta: dict) -> list[int]:
    """Convert and save the tokenizer; write generation_config.json. Returns the end ids."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except ValueError as err:  # AutoTokenizer reads the config of architectures transformers runs (not qwen3next)
        if "is not supported yet" not in str(err):
            raise
        from transformers import PreTrainedTokenizerFast  # the same tokenizer, from the GGUF's tokenizer fields only

        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(str(out_dir))
    config_path = out_dir / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text())
    for leftover in ("is_local", "local_files_only"):  # from_pretrained's own arguments
        tok_config.pop(leftover, None)
    if tok_config.get("tokenizer_class") == "TokenizersBackend":  # transformers 5's name; 4.x knows this
        tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    if tokenizer.chat_template:
        tok_config["chat_template"] = tokenizer.chat_template
    config_path.write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n")
    eos = end_of_generation_ids(meta, template_end_token(tokenizer))
    generation = {
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return eos


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, log: Callable[[str], None] = print,
                 tokenizer: bool = True, weights: bool = True) -> dict:
    """Write `out_dir`/{config.json, model.safetensors, tokenizer files, generation_config.json}
    (`weights=False`: all but model.safetensors, for a folder that reads the GGUF itself:
    catalog/imported.py).

    Returns the config dict written. `out_dir` is created if needed; existing files are replaced.
    """
    import gguf

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    try:
        reader = gguf.GGUFReader(str(gguf_path))
    except (ValueError, OSError, KeyError) as err:
        raise ModelError(f"{gguf_path} is not a readable GGUF file ({err}); re-download it") from None
    meta = read_metadata(reader)
    shapes = {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    config = hf_config(meta, shapes, None if freqs is None else _float32_rows(freqs).reshape(-1).tolist())
    if weights and (meta["general.architecture"] in (*gguf_hybrid.MODELS, gguf_deepseek.ARCH) or gguf_moe.is_moe(meta)):
        raise ModelError(f"{gguf_path.name}: a {meta['general.architecture']} GGUF is read in place, not converted to "
                         "safetensors; import it (outrider models import FILE.gguf, or --model FILE.gguf)")
    out_dir.mkdir(parents=True, exist_ok=True)
    log(f"converting {gguf_path.name}: {config['model_type']}, {config['num_hidden_layers']} layers, "
        f"{len(shapes)} tensors" + (" -> float32 safetensors" if weights else " (its metadata; the weights stay in it)"))
    if weights:
        permuted = ARCHITECTURES[meta["general.architecture"]][2]
        rotary_heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
        write_weights(reader, out_dir / "model.safetensors", rotary_heads if permuted else {}, log)
    if tokenizer:
        log("converting the tokenizer")
        eos = write_tokenizer(gguf_path, out_dir, meta)
        log(f"  end-of-generation ids: {eos}")
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return config
