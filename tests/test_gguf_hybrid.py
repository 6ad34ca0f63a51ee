"""A Qwen3.5 gated-delta hybrid from a GGUF (llama.cpp's architecture `qwen35`): the tiny model
test_hybrid.py runs, written in the converter's layout (tests/qwen35_gguf.py; checked against the
real converter by scripts/check_qwen35_gguf_layout.py), read back with every transform undone:
the safetensors load's logits bit for bit, its own quantized blocks kept, speculation exact."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.errors import ModelError
from outrider.models.batch import pack
from outrider.sampling import SamplingParams
from outrider.weights import gguf_hybrid
from outrider.weights.gguf_convert import convert_gguf, hf_config
from outrider.weights.loader import load_decoder
from qwen35_gguf import write_qwen35_gguf
from tiny import make_tiny

TOKENS = torch.tensor([3, 9, 4, 11, 7, 8, 20, 5, 3, 9, 60, 61, 62, 63, 12, 30, 31, 2, 9, 4])
PROMPT = [5, 17, 33, 8, 5, 17, 33, 9, 40, 41]


def quiet(line: str) -> None:
    pass


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """test_hybrid's tiny layout (2 key heads, 4 value heads: the value heads are reordered) over
    the BPE's 264 tokens, its norms, A_log and dt_bias drawn at random (transformers sets constants),
    and a multi-token-prediction head as Qwen3.5 checkpoints keep one (`mtp.*`; transformers does
    not save it; the safetensors load does not read it)."""
    folder = make_tiny("qwen3_5", tmp_path_factory.mktemp("hybrid-gguf") / "hf", vocab=264, layers=4)
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    g = torch.Generator().manual_seed(7)
    for name, t in tensors.items():
        if t.dim() == 1:
            tensors[name] = torch.randn(t.shape, generator=g) * 0.3
    for name in [n for n in tensors if n.startswith("model.layers.3.")]:  # an attention layer
        tensors["mtp.layers.0." + name.removeprefix("model.layers.3.")] = torch.randn(tensors[name].shape, generator=g)
    tensors["mtp.fc.weight"] = torch.randn(64, 128, generator=g)
    for part in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{part}.weight"] = torch.randn(64, generator=g)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return folder


def imported(hf, root, qtype: str, mtp: bool = False):
    """An imported folder (config.json, tokenizer, the GGUF beside them) as catalog/imported.py lays
    it out; mtp: the folder's multi-token-prediction head kept (the converter's default)."""
    folder = root / qtype
    folder.mkdir()
    write_qwen35_gguf(hf, root / f"{qtype}.gguf", qtype, mtp=mtp)
    convert_gguf(root / f"{qtype}.gguf", folder, log=quiet, weights=False)
    os.link(root / f"{qtype}.gguf", folder / "original.gguf")
    return folder


@pytest.fixture(scope="module")
def f32(hf, tmp_path_factory):
    return imported(hf, tmp_path_factory.mktemp("f32"), "F32")


@pytest.fixture(scope="module")
def q8(hf, f32, tmp_path_factory):
    return imported(hf, tmp_path_factory.mktemp("q8"), "Q8_0", mtp=True)  # the converter's q8_0: ffn_down F16


@pytest.fixture(scope="module")
def want(hf):
    """The safetensors load's logits."""
    return logits(load_decoder(hf, "cpu", torch.float32))


def logits(model) -> torch.Tensor:
    cache = model.new_cache(1, 32)
    return model.forward(pack([0], [0], [TOKENS], scratch_row=cache.scratch_row), cache).logits[0]


def test_the_config_is_the_folders(hf, f32):
    want, got = json.loads((hf / "config.json").read_text()), json.loads((f32 / "config.json").read_text())
    for key in ("architectures", "layer_types", "hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "head_dim", "linear_conv_kernel_dim", "linear_key_head_dim",
                "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads", "vocab_size",
                "tie_word_embeddings"):
        assert got[key] == want[key], key
    assert got["rope_parameters"]["partial_rotary_factor"] == 0.25 and got["rms_norm_eps"] == 1e-5


def test_a_float_gguf_is_the_safetensors_model_bit_for_bit(hf, f32, want, tmp_path):
    """Every transform the converter made (value heads reordered, -exp(A_log), 1 + w norms, conv1d
    squeezed) undone exactly: the same weights, so the same logits to the bit; with the MTP head
    kept (block 4, not read) too."""
    assert torch.equal(logits(load_decoder(f32, "cpu", torch.float32)), want)
    with_mtp = imported(hf, tmp_path, "F32", mtp=True)
    assert json.loads((with_mtp / "config.json").read_text())["num_hidden_layers"] == 4
    assert torch.equal(logits(load_decoder(with_mtp, "cpu", torch.float32)), want)


@pytest.mark.parametrize("broken", ["rows", "columns", "folded"])
def test_each_undo_is_needed(f32, want, monkeypatch, broken):
    """The control: leave one transform in place and the logits move."""
    if broken == "folded":
        monkeypatch.setattr("outrider.weights.loader.norms_folded", lambda source: False)
    else:
        monkeypatch.setattr(gguf_hybrid.VHeadOrder, broken, lambda self, *a: None)
    assert (logits(load_decoder(f32, "cpu", torch.float32)) - want).abs().max() > 1e-3


@pytest.mark.parametrize("qtype, dtype", [("Q8_0", "gguf"), ("Q4_0", "gguf"), ("Q5_0", "gguf"), ("Q4_1", "q4")])
def test_a_quantized_gguf_runs_its_own_blocks(hf, tmp_path, qtype, dtype):
    """--dtype gguf (or q4 on 4-bit blocks) keeps every projection of the hybrid in the file's blocks (the gated-delta
    in_proj parts and out_proj, whose input is gathered into the file's column order; q_proj's
    query and gate rows): the float model of the same file's values, up to float rounding."""
    from outrider.kernels.quant_linear import QuantLinear

    folder = imported(hf, tmp_path, qtype)
    blocks = load_decoder(folder, "cpu", dtype)
    delta = blocks.layers[0].delta
    assert isinstance(delta.in_proj, QuantLinear) and isinstance(delta.out, gguf_hybrid.InputOrder)
    got, want = logits(blocks), logits(load_decoder(folder, "cpu", torch.float32))
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()


@pytest.mark.parametrize("which, dtype", [("f32", torch.float32), ("q8", "gguf")])
def test_greedy_suffix_speculation_equals_plain(which, dtype, request):
    folder = request.getfixturevalue(which)
    model = load_decoder(folder, "cpu", dtype)
    requests = [Request(PROMPT, 16, SamplingParams(0.0)), Request(PROMPT[::-1], 12, SamplingParams(0.0))]
    plain = [f.token_ids for f in generate_ids(model, requests, set())]
    spec = Speculator.build(SpecOptions("suffix", "chain", "fixed:4"), model, folder)
    fast = generate_ids(model, requests, set(), speculation=spec)
    assert [f.token_ids for f in fast] == plain and all(len(t) > 0 for t in plain)


def test_the_cli_checks_and_runs_a_gguf_file(hf, q8, tmp_path, runtime, capsys, monkeypatch):
    from outrider.cli import main

    runtime(cache_dir=str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    gguf = q8 / "original.gguf"
    assert main(["models", "check", str(gguf)]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("supported: ") and "Qwen3_5ForCausalLM, 4 layers (attention, gated_delta)" in line, line
    args = ["generate", "--model", str(gguf), "--json", "--max-new-tokens", "10", "the the a"]
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)["token_ids"]
    assert main([*args, "--drafter", "suffix"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == plain and plain


def test_what_is_not_read_is_refused_in_one_line(f32, tmp_path):
    import gguf

    meta = {k: f.contents() for k, f in gguf.GGUFReader(str(f32 / "original.gguf")).fields.items()}
    shapes = {"blk.3.attn_q.weight": (256, 64), "token_embd.weight": (264, 64)}
    with pytest.raises(ModelError, match="nextn_predict_layers 4 of 4 blocks"):
        hf_config({**meta, "qwen35.nextn_predict_layers": 4}, shapes)
    with pytest.raises(ModelError, match="read in place"):  # no float32 safetensors written for a hybrid
        convert_gguf(f32 / "original.gguf", tmp_path / "out", log=quiet)


def random_hybrid(hf, folder):
    """The tiny hybrid's layout at K-quant widths (hidden 256, 4 value heads of 64: rows of 256
    values), random weights under its Hugging Face names; no model built (only the GGUF's blocks
    against the same file's values are compared)."""
    c = json.loads((hf / "config.json").read_text())
    c.update(hidden_size=256, intermediate_size=512, linear_key_head_dim=32, linear_value_head_dim=64)
    E, I, V, H, G, D = 256, 512, c["vocab_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    HK, HV, dk, dv, K = 2, 4, 32, 64, c["linear_conv_kernel_dim"]
    g = torch.Generator().manual_seed(3)
    shapes = {"model.embed_tokens.weight": (V, E), "lm_head.weight": (V, E), "model.norm.weight": (E,)}
    for i, kind in enumerate(c["layer_types"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (E,), p + "post_attention_layernorm.weight": (E,),
                       p + "mlp.gate_proj.weight": (I, E), p + "mlp.up_proj.weight": (I, E), p + "mlp.down_proj.weight": (E, I)})
        if kind == "full_attention":
            a = p + "self_attn."
            shapes.update({a + "q_proj.weight": (H * 2 * D, E), a + "k_proj.weight": (G * D, E), a + "v_proj.weight": (G * D, E),
                           a + "o_proj.weight": (E, H * D), a + "q_norm.weight": (D,), a + "k_norm.weight": (D,)})
        else:
            a = p + "linear_attn."
            shapes.update({a + "in_proj_qkv.weight": (2 * HK * dk + HV * dv, E), a + "in_proj_z.weight": (HV * dv, E),
                           a + "in_proj_b.weight": (HV, E), a + "in_proj_a.weight": (HV, E),
                           a + "conv1d.weight": (2 * HK * dk + HV * dv, 1, K), a + "A_log": (HV,), a + "dt_bias": (HV,),
                           a + "norm.weight": (dv,), a + "out_proj.weight": (E, HV * dv)})
    folder.mkdir()
    save_file({n: torch.randn(s, generator=g) * (0.3 if len(s) == 1 else 0.05) for n, s in shapes.items()},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(c))
    return folder


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_k_quant_blocks_run_too(hf, tmp_path, qtype):
    """Q4_K and Q6_K projections (random blocks: gguf-py writes no K-quants) kept in their blocks,
    a 256-value super-block spanning four value heads of ssm_out (the input gathered): the float
    model of the same file's values, up to float rounding."""
    from outrider.kernels.quant_linear import QuantLinear

    folder = imported(random_hybrid(hf, tmp_path / "hf"), tmp_path, qtype)
    blocks = load_decoder(folder, "cpu", "gguf")
    delta = blocks.layers[0].delta
    assert isinstance(delta.in_proj, QuantLinear) and isinstance(delta.out, gguf_hybrid.InputOrder)
    got, want = logits(blocks), logits(load_decoder(folder, "cpu", torch.float32))
    assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (got - want).abs().max()  # logits in the hundreds
