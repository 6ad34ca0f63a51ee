"""GGUF import: tensors, config, tokenizer and logits against transformers' own GGUF loader.

`write_tiny_gguf` writes a tiny random model (llama, qwen2 or qwen3) with a small byte-level BPE
tokenizer and a ChatML template, laid out as llama.cpp's converter lays it out (llama Q/K rows
permuted, optional quantization); test_catalog.py builds its fake wheels from it too.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]


def _tokenizer_vocab() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = sorted(bytes_to_unicode().values())
    return SPECIALS + alphabet + ["Ġt", "he", "Ġthe", "in", "Ġa"]


def _llama_cpp_permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to llama Q/K rows: halves -> interleaved pairs."""
    d = rows.shape[0] // heads
    return rows.reshape(heads, 2, d // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def write_tiny_gguf(path: Path, arch: str = "llama", qtype: str = "F32", tied: bool = True,
                    seed: int = 0) -> dict[str, np.ndarray]:
    """Write a 2-layer random model to `path`; returns its weights in Hugging Face layout/names."""
    import gguf

    rng = np.random.default_rng(seed)
    tokens = _tokenizer_vocab()
    vocab, hidden, ffn, heads, kv_heads = len(tokens), 32, 64, 4, 2
    head_dim = 128 if arch == "qwen3" else hidden // heads  # transformers' Qwen3 GGUF default
    rand = lambda *shape: rng.standard_normal(shape).astype(np.float32) * 0.2  # noqa: E731
    hf: dict[str, np.ndarray] = {"model.embed_tokens.weight": rand(vocab, hidden),
                                 "model.norm.weight": 1 + rand(hidden)}
    if not tied:
        hf["lm_head.weight"] = rand(vocab, hidden)
    for i in range(2):
        p = f"model.layers.{i}."
        hf.update({p + "input_layernorm.weight": 1 + rand(hidden),
                   p + "post_attention_layernorm.weight": 1 + rand(hidden),
                   p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
                   p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
                   p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
                   p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
                   p + "mlp.gate_proj.weight": rand(ffn, hidden),
                   p + "mlp.up_proj.weight": rand(ffn, hidden),
                   p + "mlp.down_proj.weight": rand(hidden, ffn)})
        if arch == "qwen2":
            hf.update({p + f"self_attn.{n}_proj.bias": rand(rows) for n, rows in
                       (("q", heads * head_dim), ("k", kv_heads * head_dim), ("v", kv_heads * head_dim))})
        if arch == "qwen3":
            hf.update({p + "self_attn.q_norm.weight": 1 + rand(head_dim),
                       p + "self_attn.k_norm.weight": 1 + rand(head_dim)})

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny {arch}")
    writer.add_block_count(2)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    if arch == "qwen3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(0)  # the document end, as many GGUFs do; the template ends with <|im_end|>
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)
    for name, rows in hf.items():
        writer.add_tensor(*_to_gguf(name, rows, arch, heads, kv_heads, qtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


def _to_gguf(name: str, rows: np.ndarray, arch: str, heads: int, kv_heads: int, qtype: str):
    """(gguf name, data, ...) for one Hugging Face tensor: renamed, permuted, maybe quantized."""
    import gguf

    renames = [("model.embed_tokens", "token_embd"), ("model.norm", "output_norm"), ("lm_head", "output"),
               ("model.layers.", "blk."), ("input_layernorm", "attn_norm"),
               ("post_attention_layernorm", "ffn_norm"), ("self_attn.q_proj", "attn_q"),
               ("self_attn.k_proj", "attn_k"), ("self_attn.v_proj", "attn_v"),
               ("self_attn.o_proj", "attn_output"), ("self_attn.q_norm", "attn_q_norm"),
               ("self_attn.k_norm", "attn_k_norm"), ("mlp.gate_proj", "ffn_gate"),
               ("mlp.up_proj", "ffn_up"), ("mlp.down_proj", "ffn_down")]
    for old, new in renames:
        name = name.replace(old, new)
    if arch == "llama" and ".attn_q." in name:
        rows = _llama_cpp_permute(rows, heads)
    if arch == "llama" and ".attn_k." in name:
        rows = _llama_cpp_permute(rows, kv_heads)
    if qtype == "F32" or rows.ndim == 1:
        return name, rows
    kind = gguf.GGMLQuantizationType[qtype]
    return name, gguf.quants.quantize(rows, kind), None, kind


# --- the tests -------------------------------------------------------------------------------

import json  # noqa: E402

import torch  # noqa: E402

from outrider.errors import ModelError  # noqa: E402
from outrider.weights.gguf_convert import (  # noqa: E402
    convert_gguf,
    end_of_generation_ids,
    hf_config,
    hf_tensor_name,
    unpermute_rotary_rows,
)

CASES = [  # arch, tensor type, tied embeddings
    ("llama", "F32", True),
    ("llama", "Q8_0", True),
    ("llama", "Q4_1", False),
    ("qwen2", "Q8_0", False),
    ("qwen3", "F32", True),
]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Every case written as a GGUF and converted once: {case: (gguf path, folder, hf weights)}."""
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for arch, qtype, tied in CASES:
        path = root / f"{arch}-{qtype}.gguf"
        weights = write_tiny_gguf(path, arch, qtype, tied)
        convert_gguf(path, root / f"{arch}-{qtype}-hf", log=lambda line: None)
        out[(arch, qtype, tied)] = (path, root / f"{arch}-{qtype}-hf", weights)
    return out


def _from_gguf(path: Path):
    """transformers' own GGUF loader on `path`, unchanged but for two memos: it parses the file
    twice (config, then tensors; for SmolLM2 the 49k-token vocabulary twice) and rebuilds gguf-py's
    tensor-name map once per module of the model (hundreds of times); each memo returns the very
    object the call would have built, so the loaded model is the same, in about half the time."""
    from unittest import mock

    import gguf
    from transformers import AutoModelForCausalLM

    readers, name_maps = {}, {}
    read, build = gguf.GGUFReader, gguf.get_tensor_name_map

    def reader(file, *args, **kwargs):
        key = (str(file), args, tuple(sorted(kwargs.items())))
        return readers[key] if key in readers else readers.setdefault(key, read(file, *args, **kwargs))

    def name_map(arch, n_blocks):
        key = (arch, n_blocks)
        return name_maps[key] if key in name_maps else name_maps.setdefault(key, build(arch, n_blocks))

    with mock.patch.object(gguf, "GGUFReader", reader), mock.patch.object(gguf, "get_tensor_name_map", name_map):
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)


def test_unpermute_undoes_llama_cpp_permutation():
    # one head of 4 rows: llama.cpp [x0, y0, x1, y1] -> Hugging Face [x0, x1, y0, y1]
    assert unpermute_rotary_rows(np.array([0, 10, 1, 11]), 1).tolist() == [0, 1, 10, 11]
    rows = np.arange(3 * 8 * 5, dtype=np.float32).reshape(24, 5)  # 3 heads of 8, 5 columns
    assert np.array_equal(unpermute_rotary_rows(_llama_cpp_permute(rows, 3), 3), rows)
    bias = np.arange(24, dtype=np.float32)
    assert np.array_equal(unpermute_rotary_rows(_llama_cpp_permute(bias, 3), 3), bias)


def test_tensor_names():
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("blk.12.attn_q.bias") == "model.layers.12.self_attn.q_proj.bias"
    assert hf_tensor_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    with pytest.raises(ModelError, match="rope_freqs"):
        hf_tensor_name("rope_freqs.weight")


def test_unsupported_architecture_is_refused():
    with pytest.raises(ModelError, match="gpt2.*not supported"):
        hf_config({"general.architecture": "gpt2"}, {})


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-{'tied' if c[2] else 'untied'}")
def test_tensors_and_logits_match_transformers_gguf_loader(converted, case):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    path, folder, weights = converted[case]
    ours = load_file(folder / "model.safetensors")
    reference = _from_gguf(path)
    expected = reference.state_dict()
    if case[2]:
        assert "lm_head.weight" not in ours
        expected.pop("lm_head.weight")  # the tied alias
    assert sorted(ours) == sorted(expected)
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, expected[name]), name
    if case[1] == "F32":  # unquantized: the round trip returns the original weights exactly
        for name, rows in weights.items():
            assert torch.equal(ours[name], torch.from_numpy(rows)), name
    model = AutoModelForCausalLM.from_pretrained(str(folder))
    ids = torch.tensor([[1, 5, 70, 80, 200, 2, 3, 261]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


@pytest.mark.parametrize("case", CASES[2:], ids=lambda c: c[0])
def test_config_matches_transformers(converted, case):
    from transformers import AutoConfig

    path, folder, _ = converted[case]
    ours = json.loads((folder / "config.json").read_text())
    reference = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    loaded = AutoConfig.from_pretrained(str(folder))
    assert ours["architectures"] == [type(reference).__name__.replace("Config", "ForCausalLM")]
    assert ours["torch_dtype"] == "float32"
    for key in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
                "vocab_size", "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        expected = getattr(reference, key, None)
        if key == "head_dim" and expected is None:  # transformers' Qwen2Config derives it
            expected = reference.hidden_size // reference.num_attention_heads
        assert getattr(loaded, key) == expected, key
        assert ours[key] == expected, key
    assert ours["rms_norm_eps"] == 1e-6  # the decimal, not float32's 9.99999997e-07
    assert loaded.rope_parameters["rope_theta"] == ours["rope_theta"] == 10000.0
    assert ours["vocab_size"] == 264 and ours["tie_word_embeddings"] is case[2]


def test_tokenizer_and_generation_config(converted):
    from transformers import AutoTokenizer

    path, folder, _ = converted[("qwen2", "Q8_0", False)]
    ours = AutoTokenizer.from_pretrained(str(folder))
    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    text = "the cat in a hat<|im_end|>"
    assert ours(text).input_ids == reference(text).input_ids
    assert ours(text).input_ids[-1] == 2  # the special token stays whole
    chat = [{"role": "user", "content": "hi"}]
    rendered = ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert json.loads((folder / "tokenizer_config.json").read_text())["chat_template"] == CHATML
    generation = json.loads((folder / "generation_config.json").read_text())
    # the GGUF's eos (<|endoftext|>, 0) and the template's end of turn (<|im_end|>, 2)
    assert generation["eos_token_id"] == [0, 2]
    assert generation["bos_token_id"] == 1


def test_end_of_generation_ids_from_metadata():
    meta = {"tokenizer.ggml.tokens": ["<s>", "a", "<|im_end|>", "<|eot_id|>", "<|endoftext|>"],
            "tokenizer.ggml.token_type": [3, 1, 3, 3, 1],
            "tokenizer.ggml.eos_token_id": 0}
    # <|endoftext|> here is a normal token, so it does not end generation
    assert end_of_generation_ids(meta) == [0, 2, 3]
    assert end_of_generation_ids(meta, template_end="<|endoftext|>") == [0, 2, 3, 4]


@pytest.mark.model
def test_smollm2_conversion_matches_transformers_gguf(smollm2_path, smollm2_tokenizer, smollm2_transformers):
    """The pulled default model gives transformers' GGUF logits exactly, and stops on <|im_end|>.

    transformers' GGUF loader is the slow part (about 14 s of CPU for this 98 MB file, half that
    with _from_gguf's memos: it reads the GGUF twice, config then tensors, and dequantizes in numpy);
    the folder's model and the tokenizer are the session's (conftest.py)."""
    from outrider.catalog import packages

    chat = [{"role": "user", "content": "What is the capital of France?"}]
    ids = smollm2_tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt",
                                                return_dict=True)["input_ids"]
    reference = _from_gguf(packages.gguf_path(packages.DEFAULT_MODEL))
    with torch.no_grad():
        assert torch.equal(smollm2_transformers(ids).logits, reference(ids).logits)
        out = smollm2_transformers.generate(ids, max_new_tokens=20, do_sample=False)
    reply = smollm2_tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in reply
    assert 2 in json.loads((smollm2_path / "generation_config.json").read_text())["eos_token_id"]
