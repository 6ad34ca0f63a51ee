"""Models with weights kept quantized: loading (float weights quantized at load, a GGUF's own
blocks), the forward against a float model of the same dequantized weights, greedy speculative
output equal to greedy autoregressive output of the same quantized model, and the refusals."""

from __future__ import annotations

import gc
import shutil
from pathlib import Path

import pytest
import torch

from outrider.errors import ConfigError, ModelError
from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.kernels import native
from outrider.models.batch import pack
from outrider.weights.loader import load_decoder
from outrider.kernels.blocks import QuantBlocks, dequantize, quantize
from outrider.kernels.quant_linear import QuantLinear
from outrider.weights.quant_load import RowStack
from test_quant import EXACT

PROJECTIONS = ("qkv", "o", "gate_up", "down")


def make_quantizable(folder: Path, seed: int = 0) -> Path:
    """A tiny random Llama whose every projection has an input size a multiple of 32."""
    import transformers as tf

    config = tf.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                            rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = tf.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # weights larger than the init, so logits are far from uniform
        for p in model.parameters():
            p.mul_(4.0 if p.dim() > 1 else 1.0)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """torch's int4 kernel (the -bf16 dtypes) splits even these tiny products across threads; on a
    shared 2-core machine that made a test 10-20x slower. These tests check outputs, not speed."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_quantizable(tmp_path_factory.mktemp("quant") / "llama")


def logits_of(model, tokens: list[int]) -> torch.Tensor:
    """The logits of a prefill of `tokens` in one slot: [T, vocab]."""
    cache = model.new_cache(1, 64)
    batch = pack([0], [0], [torch.tensor(tokens)], scratch_row=cache.scratch_row)
    return model.forward(batch, cache).logits[0]


def dequantized_copy(model, folder: Path, kinds: dict[str, str]):
    """The float model with each weight replaced by dequantize(quantize(weight, kind)): the
    reference the quantized model must match up to float rounding."""
    ref = load_decoder(folder, "cpu")
    round_trip = lambda w, kind: dequantize(quantize(w, kind))  # noqa: E731
    for layer in ref.layers:
        for name in PROJECTIONS:
            setattr(layer, name, round_trip(getattr(layer, name), kinds["projections"]))
    ref.lm_head = round_trip(ref.lm_head, kinds["head"])
    ref.embed = round_trip(ref.embed, kinds["head"])
    return ref


KINDS_OF = {"q8_0": {"projections": "q8_0", "head": "q8_0"}, "q4": {"projections": "q4_1", "head": "q8_0"}}
AT_LOAD = {**KINDS_OF, "q4_0": {"projections": "q4_0", "head": "q4_0"}}  # q4_0: no bf16 form


@pytest.mark.parametrize("dtype", AT_LOAD)
def test_quantized_at_load_equals_dequantized_float_model(folder, dtype):
    """The forward (float32 kernel) is the float model of the dequantized blocks, up to float32
    rounding: the loader quantizes and wires every weight as it should."""
    kinds = AT_LOAD[dtype]
    model = load_decoder(folder, "cpu", dtype)
    assert model.dtype == torch.float32 and model.device.type == "cpu" and model.quantization == dtype
    for layer in model.layers:
        for name in PROJECTIONS:
            weight = getattr(layer, name)
            assert isinstance(weight, QuantLinear) and weight.kind == kinds["projections"]
            assert weight.kernel == EXACT
    assert isinstance(model.lm_head, QuantLinear) and model.lm_head.kind == kinds["head"]
    assert isinstance(model.embed, QuantBlocks) and model.embed.kind == kinds["head"]
    tokens = [5, 17, 3, 88, 41, 41, 9]
    got, ref = logits_of(model, tokens), logits_of(dequantized_copy(model, folder, kinds), tokens)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    plain = logits_of(load_decoder(folder, "cpu"), tokens)
    assert (got - plain).abs().max() > 1e-2  # it really is another model than the float one


@pytest.mark.parametrize("dtype", KINDS_OF)
def test_bf16_kernels_stay_close_to_the_dequantized_model(folder, dtype):
    """"q4-bf16-lossy" / "q8_0-bf16-lossy": torch's int4 kernel in bfloat16 (quant_linear.py); the logits stay
    within 3% of their scale of the dequantized model's, and well closer to it than to the float
    model's."""
    model = load_decoder(folder, "cpu", f"{dtype}-bf16-lossy")
    assert model.layers[0].qkv.kernel in ("int4pack", "int4pair") and model.quantization == f"{dtype}-bf16-lossy"
    tokens = [5, 17, 3, 88, 41, 41, 9]
    got = logits_of(model, tokens)
    ref = logits_of(dequantized_copy(model, folder, KINDS_OF[dtype]), tokens)
    plain = logits_of(load_decoder(folder, "cpu"), tokens)
    error = (got - ref).abs().max()
    assert error <= 0.03 * ref.abs().max()
    assert error <= 0.5 * (ref - plain).abs().max()


def test_projection_with_ragged_input_stays_float(tiny_folders):
    """tests/tiny.py's models have intermediate size 112: the down projection cannot be cut into
    blocks of 32, so it stays float; the others are quantized."""
    model = load_decoder(tiny_folders["llama"], "cpu", "q4")
    assert isinstance(model.layers[0].down, torch.Tensor)
    assert isinstance(model.layers[0].gate_up, QuantLinear)


def test_tied_head_shares_the_embedding_blocks(tiny_folders):
    """A tied head multiplies with the embedding table's own codes (no second copy in memory)."""
    from outrider.kernels import native

    if not native.available():
        pytest.skip(native.reason())
    for dtype in ("q4", "q8_0"):
        model = load_decoder(tiny_folders["llama-tied"], "cpu", dtype)
        assert model.lm_head.kernel == "native"
        assert model.lm_head.state["weight"].q.data_ptr() == model.embed.q.data_ptr()


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads Linux's /proc/self/maps")
def test_a_quantized_load_leaves_no_file_mapped(tiny_folders, tmp_path):
    """The weights were read and quantized: the model keeps no view into the memory-mapped file
    (a kept norm vector would keep every page of it mapped and resident). A copy of its own: the
    session's folder may be mapped by a float model another test of this process holds."""
    folder = Path(shutil.copytree(tiny_folders["llama"], tmp_path / "llama"))
    model = load_decoder(folder, "cpu", "q4")
    gc.collect()
    mapped = [line for line in Path("/proc/self/maps").read_text().splitlines() if str(folder) in line]
    assert model.layers and not mapped


# -- greedy speculative == greedy autoregressive, on the quantized model ---------------------------

def prompts():
    g = torch.Generator().manual_seed(5)
    base = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (1, 7)]
    return base + [[10, 11, 12, 13, 10, 11, 12, 13, 10, 11]]  # a repeat, so lookups find matches


def run(target, spec=None, n=16):
    return [f.token_ids for f in generate_ids(target, [Request(p, n) for p in prompts()], set(), speculation=spec)]


def speculator(drafter, shape="chain", depth=4):
    from outrider.control.controllers import FixedController
    from outrider.engine.speculator import SpecOptions, Speculator
    from outrider.spec.shapes import parse_shape

    return Speculator(SpecOptions(drafter.name, shape, f"fixed:{depth}"), drafter, FixedController(depth),
                      parse_shape(shape))


NO_LANES = pytest.mark.skipif(not native.i8_available(), reason="int8-activation kernel: none here (it needs AVX2)")


@pytest.fixture(scope="module", params=["q4", "q8_0", pytest.param("q4-i8", marks=NO_LANES),
                                        pytest.param("q8_0-i8", marks=NO_LANES)])
def quantized(request, folder):
    model = load_decoder(folder, "cpu", request.param)
    return model, run(model)


def test_greedy_ngram_and_suffix(quantized):
    from outrider.drafters.ngram import NgramDrafter
    from outrider.drafters.suffix import SuffixDrafter

    model, plain = quantized
    for drafter in (NgramDrafter(), SuffixDrafter()):
        outs = generate_ids(model, [Request(p, 16) for p in prompts()], set(), speculation=speculator(drafter))
        assert [f.token_ids for f in outs] == plain
        assert sum(f.round_stats.committed for f in outs) > sum(f.round_stats.rounds for f in outs)  # drafts were accepted


@pytest.mark.parametrize("shape", ["chain", "static:2,2,1"])
def test_greedy_early_exit(quantized, shape):
    from outrider.drafters.model import ModelDrafter
    from outrider.spec.shapes import parse_shape

    model, plain = quantized
    drafter = ModelDrafter(model, parse_shape(shape), num_layers=1, name="early-exit:1")
    assert run(model, speculator(drafter, shape)) == plain


@pytest.mark.parametrize("shape", ["chain", "static:2,2,1"])
def test_greedy_self_draft_accepts_everything(quantized, shape):
    """The quantized target drafting for itself: every draft accepted, every commit path used."""
    from outrider.drafters.model import ModelDrafter
    from outrider.spec.shapes import parse_shape

    model, plain = quantized
    outs = generate_ids(model, [Request(p, 16) for p in prompts()], set(),
                        speculation=speculator(ModelDrafter(model, parse_shape(shape), name="self"), shape))
    assert [f.token_ids for f in outs] == plain
    assert all(f.round_stats.committed / f.round_stats.rounds >= 4.0 for f in outs)


# -- a GGUF's own blocks ----------------------------------------------------------------------------

def gguf_folder(root: Path, qtype: str = "Q4_1", odd_tensor: tuple[str, str] | None = None) -> Path:
    """A tiny GGUF (tests/test_gguf_import.py's writer, llama rows permuted as llama.cpp does)
    converted to a float folder that keeps the GGUF as original.gguf, as a pull does.
    `odd_tensor` = (Hugging Face name, GGUF type) writes that one tensor in another type."""
    import test_gguf_import as writer
    from outrider.weights.gguf_convert import convert_gguf

    root.mkdir(parents=True)
    path = root / "model.gguf"
    original = writer._to_gguf

    def to_gguf(name, rows, arch, heads, kv_heads, qtype_):
        if odd_tensor and name == odd_tensor[0]:
            qtype_ = odd_tensor[1]
        return original(name, rows, arch, heads, kv_heads, qtype_)

    writer._to_gguf = to_gguf
    try:
        writer.write_tiny_gguf(path, "llama", qtype=qtype, tied=True)
    finally:
        writer._to_gguf = original
    folder = root / "folder"
    convert_gguf(path, folder, log=lambda line: None, tokenizer=False)
    shutil.copyfile(path, folder / "original.gguf")
    return folder


def test_gguf_blocks_load_natively(tmp_path):
    """--dtype q4 on a Q4_1 GGUF keeps its blocks (llama Q/K rows put back in Hugging Face order):
    the same logits as the float folder converted from the same GGUF, up to float rounding."""
    from outrider.weights.quant_load import QuantTensors
    from outrider.weights.loader import _Tensors

    folder = gguf_folder(tmp_path / "q4_1")
    assert QuantTensors(folder, "q4", _Tensors(folder)).source == "GGUF blocks (original.gguf)"
    model = load_decoder(folder, "cpu", "q4")
    assert model.layers[0].qkv.kind == "q4_1" and model.embed.kind == "q4_1"  # the GGUF's own table
    assert model.lm_head.kernel == EXACT
    tokens = [5, 17, 3, 88, 41, 41, 9, 200]
    ref = logits_of(load_decoder(folder, "cpu"), tokens)
    torch.testing.assert_close(logits_of(model, tokens), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_q4_0_requantizes_a_gguf_folder_from_its_floats(tmp_path):
    """--dtype q4_0 never takes the GGUF's blocks: every weight is the float folder's, quantized
    to Q4_0 at load (the smallest model a step reads, e.g. for a drafter)."""
    folder = gguf_folder(tmp_path / "q4_1")
    model = load_decoder(folder, "cpu", "q4_0")
    assert {model.layers[0].qkv.kind, model.lm_head.kind, model.embed.kind} == {"q4_0"}
    assert model.lm_head.nbytes() < load_decoder(folder, "cpu", "q4").lm_head.nbytes()


def test_gguf_of_another_family_is_quantized_from_floats(tmp_path):
    from outrider.weights.quant_load import QuantTensors
    from outrider.weights.loader import _Tensors

    folder = gguf_folder(tmp_path / "q4_1")
    assert QuantTensors(folder, "q8_0", _Tensors(folder)).source == "float weights quantized at load"
    assert load_decoder(folder, "cpu", "q8_0").layers[1].gate_up.kind == "q8_0"


def test_mixed_kinds_are_stacked(tmp_path):
    """A GGUF that keeps V in Q8_0 and Q, K in Q4_1 (llama.cpp's mixed presets do): the fused QKV
    is a RowStack, and the forward still equals the float model's."""
    folder = gguf_folder(tmp_path / "mixed", odd_tensor=("model.layers.0.self_attn.v_proj.weight", "Q8_0"))
    model = load_decoder(folder, "cpu", "q4")
    assert isinstance(model.layers[0].qkv, RowStack) and isinstance(model.layers[1].qkv, QuantLinear)
    tokens = [5, 17, 3, 88]
    ref = logits_of(load_decoder(folder, "cpu"), tokens)
    torch.testing.assert_close(logits_of(model, tokens), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_unsupported_gguf_type_falls_back_to_quantizing_the_floats(tmp_path, capsys):
    """A GGUF with kinds we cannot keep (Q5_1 here; Q2_K, Q3_K, Q5_K likewise) is not used
    natively: the folder's float weights are quantized at load, and one warning line says so."""
    folder = gguf_folder(tmp_path / "q5", odd_tensor=("model.layers.0.mlp.down_proj.weight", "Q5_1"))
    model = load_decoder(folder, "cpu", "q4")
    message = capsys.readouterr().err.strip()
    assert "\n" not in message and message.startswith("warning:")
    assert "blk.0.ffn_down.weight" in message and "Q5_1" in message and "Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q6_K" in message
    assert "--dtype float32" in message
    assert model.quantization == "q4" and isinstance(model.layers[0].qkv, QuantLinear)
    tokens = [5, 17, 3, 88]  # Q4_1 of the float weights: close to the float model, not equal
    ref, got = logits_of(load_decoder(folder, "cpu"), tokens), logits_of(model, tokens)
    assert (got - ref).abs().max() < 0.25 * ref.abs().max() and not torch.equal(got, ref)
    with pytest.raises(ModelError, match="Q5_1 tensors"):  # --dtype gguf asks for the file's own blocks
        load_decoder(folder, "cpu", "gguf")


def test_q5_0_is_kept_exactly(tmp_path):
    """A Q5_0 tensor (weights/quant_convert.py) is kept as Q8_0 codes with the same scales: the model is
    the GGUF's own, so its logits are the float folder's up to float32 rounding; "gguf" names it."""
    from outrider.weights.quant_load import QuantTensors, own_quantization
    from outrider.weights.loader import _Tensors

    folder = gguf_folder(tmp_path / "q5", odd_tensor=("model.layers.0.mlp.down_proj.weight", "Q5_0"))
    assert QuantTensors(folder, "gguf", _Tensors(folder)).source == "GGUF blocks (original.gguf)"
    assert own_quantization(folder) == "gguf"
    model = load_decoder(folder, "cpu", "gguf")
    assert model.layers[0].down.kind == "q8_0" and model.layers[1].down.kind == "q4_1"
    tokens = [5, 17, 3, 88, 41]
    ref = logits_of(load_decoder(folder, "cpu"), tokens)
    torch.testing.assert_close(logits_of(model, tokens), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_gguf_dtype_needs_a_gguf(folder):
    with pytest.raises(ModelError, match="--dtype gguf"):
        load_decoder(folder, "cpu", "gguf")


# -- the API ----------------------------------------------------------------------------------------

def test_llm_takes_quantized_dtypes(tiny_folders):
    from outrider import LLM

    llm = LLM(str(tiny_folders["llama"]), dtype="q8_0", drafter="suffix")
    assert isinstance(llm.target.layers[0].qkv, QuantLinear)
    assert isinstance(llm.generate("w5 w6 w7", max_new_tokens=8).text, str)
    with pytest.raises(ConfigError, match="q8_0, q4, q4_0, gguf, q8_0-i8, q4-i8, q4_0-i8, gguf-i8, q8_0-bf16-lossy, q4-bf16-lossy"):
        LLM(str(tiny_folders["llama"]), dtype="q3")


def test_verify_cost_profile_is_kept_apart_for_quantized_weights(folder):
    """The cost controller's cached profile is per weights kind: a q4 target does not reuse the
    float32 one (its verify costs differ)."""
    from outrider.control.profile import profile_key

    keys = {profile_key(folder, load_decoder(folder, "cpu", dtype)) for dtype in (None, "q4", "q8_0")}
    assert len(keys) == 3
