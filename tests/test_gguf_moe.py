"""Qwen3-MoE, OLMoE and Mixtral from GGUFs (llama.cpp's architectures `qwen3moe`, `olmoe`, and
`llama` with experts): tiny random models saved by transformers, written in the converter's layout
(tests/moe_gguf.py: experts stacked in 3-D, the router in F32, Mixtral's Q/K rows permuted), read
in place: the safetensors load's logits bit for bit from F32, the file's own Q8_0 blocks kept for
every expert, greedy speculation on them equal to plain."""

from __future__ import annotations

import json
import os

import pytest
import torch

from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.errors import ModelError
from outrider.models.moe_config import experts_of
from outrider.sampling import SamplingParams
from outrider.weights.gguf_convert import convert_gguf
from outrider.weights.loader import load_decoder
from moe_gguf import write_moe_gguf
from tiny import logits_in_steps

TOKENS = torch.randint(3, 264, (24,), generator=torch.Generator().manual_seed(6))
PROMPT = [5, 17, 33, 8, 5, 17, 33, 9, 40, 41]
SIZES = dict(vocab_size=264, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5, tie_word_embeddings=False)
MODELS = {  # Qwen3-MoE: its second layer dense (mlp_only_layers), as the converter writes it
    "qwen3-moe": lambda tf: tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(
        **SIZES, head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=[1])),
    "olmoe": lambda tf: tf.OlmoeForCausalLM(tf.OlmoeConfig(
        **SIZES, intermediate_size=32, num_experts=6, num_experts_per_tok=3, norm_topk_prob=False)),
    "mixtral": lambda tf: tf.MixtralForCausalLM(tf.MixtralConfig(
        **SIZES, intermediate_size=32, num_local_experts=6, num_experts_per_tok=2)),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{name: (the transformers folder, {qtype: the imported GGUF folder})}."""
    import transformers as tf

    torch.set_num_threads(1)
    out = {}
    for name in MODELS:
        root = tmp_path_factory.mktemp(name)
        torch.manual_seed(8)
        model = MODELS[name](tf).eval()
        with torch.no_grad():  # larger weights than the init, random norms: logits far from uniform
            for p in model.parameters():
                p.mul_(4.0) if p.dim() > 1 else p.normal_(1.0, 0.3)
        model.save_pretrained(root / "hf")
        imported = {}
        for qtype in ("F32", "Q8_0"):
            folder = root / qtype
            folder.mkdir()
            write_moe_gguf(root / "hf", root / f"{qtype}.gguf", qtype)
            convert_gguf(root / f"{qtype}.gguf", folder, log=lambda line: None, weights=False)
            os.link(root / f"{qtype}.gguf", folder / "original.gguf")
            imported[qtype] = folder
        out[name] = root / "hf", imported
    return out


@pytest.mark.parametrize("name", MODELS)
def test_a_float_gguf_is_the_safetensors_model_bit_for_bit(folders, name):
    hf, imported = folders[name]
    config, want = (json.loads((f / "config.json").read_text()) for f in (imported["F32"], hf))
    for key in ("architectures", "num_experts_per_tok", "moe_intermediate_size", "mlp_only_layers", "norm_topk_prob"):
        assert config.get(key) == want.get(key), key
    assert experts_of(config) == experts_of(want) > 0
    model, source = load_decoder(imported["F32"], "cpu", torch.float32), load_decoder(hf, "cpu", torch.float32)
    assert model.config == source.config
    for cuts in ([0, 24], [0, 9, 17, *range(18, 25)]):
        assert torch.equal(logits_in_steps(model, TOKENS, cuts), logits_in_steps(source, TOKENS, cuts))


@pytest.mark.parametrize("name", MODELS)
def test_q8_0_experts_run_on_their_own_blocks_and_speculation_is_exact(folders, name):
    from outrider.kernels.quant_linear import QuantLinear

    folder = folders[name][1]["Q8_0"]
    model = load_decoder(folder, "cpu", "gguf")
    moe = model.layers[0].moe
    assert isinstance(moe.gate_up[0], QuantLinear) and isinstance(moe.down[-1], QuantLinear)
    assert moe.router.dtype == torch.float32
    got, want = logits_in_steps(model, TOKENS, [0, 24]), logits_in_steps(load_decoder(folder, "cpu", torch.float32),
                                                                         TOKENS, [0, 24])
    assert torch.allclose(got, want, atol=1e-4 * float(want.abs().max())), (got - want).abs().max()
    requests = [Request(PROMPT, 16, SamplingParams(0.0)), Request(PROMPT[::-1], 12, SamplingParams(0.0))]
    plain = [f.token_ids for f in generate_ids(model, requests, set())]
    for drafter, tree in (("suffix", "chain"), (f"draft-model:{folder}", "static:2,2,1")):
        spec = Speculator.build(SpecOptions(drafter, tree, "fixed:3"), model, folder)
        assert [f.token_ids for f in generate_ids(model, requests, set(), speculation=spec)] == plain


def test_an_moe_gguf_is_read_in_place_not_converted(folders, tmp_path):
    gguf = folders["mixtral"][1]["F32"] / "original.gguf"
    with pytest.raises(ModelError, match="read in place") as err:
        convert_gguf(gguf, tmp_path / "out", log=lambda line: None)
    assert "\n" not in str(err.value)
