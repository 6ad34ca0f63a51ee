"""DeepSeek-V2 and V3 from GGUFs (llama.cpp's architecture `deepseek2`: latent attention, shared and
routed experts; weights/gguf_deepseek.py): tiny random models saved by transformers, written in the
converter's layout (tests/deepseek_gguf.py: experts stacked in 3-D, kv_b_proj whole as a legacy
file keeps it or split into attn_k_b / attn_v_b as the current converter writes it), read in place:
the safetensors load's logits bit for bit from F32 in both forms and transformers' own logits
(a whole prefill, a chunked one, decode steps); the file's own Q8_0 blocks kept for every expert,
greedy speculation on them equal to plain."""

from __future__ import annotations

import json
import os

import pytest
import torch

from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.errors import ModelError
from outrider.sampling import SamplingParams
from outrider.weights import gguf_deepseek
from outrider.weights.gguf_convert import convert_gguf
from outrider.weights.gguf_index import GGUFIndex
from outrider.weights.loader import load_decoder
from deepseek_gguf import write_deepseek_gguf
from tiny import logits_in_steps

TOKENS = torch.randint(3, 264, (24,), generator=torch.Generator().manual_seed(6))
PROMPT = [5, 17, 33, 8, 5, 17, 33, 9, 40, 41]
CUTS = {"whole": [0, 24], "chunked": [0, 9, 17, 24], "decode": [0, 17, *range(18, 25)]}
SIZES = dict(vocab_size=264, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, max_position_embeddings=256,
             bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-6, tie_word_embeddings=False,
             rope_parameters={"rope_type": "default", "rope_theta": 100.0}, n_routed_experts=8, num_experts_per_tok=3,
             moe_intermediate_size=32, n_shared_experts=2, first_k_dense_replace=1, n_group=4, topk_group=2)
MODELS = {  # V2: one q_proj, group_limited_greedy; V3: a q LoRA, sigmoid noaux_tc, renormalised
    "v2": (lambda tf: tf.DeepseekV2ForCausalLM(tf.DeepseekV2Config(
        **SIZES, q_lora_rank=None, topk_method="group_limited_greedy", routed_scaling_factor=1.5)), None),
    "v3": (lambda tf: tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(
        **SIZES, q_lora_rank=32, norm_topk_prob=True, routed_scaling_factor=2.5)), "sigmoid"),
}
FILES = {"F32-split": ("F32", True), "F32-whole": ("F32", False), "Q8_0-split": ("Q8_0", True)}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{name: (the transformers folder, its logits over TOKENS, {file: the imported GGUF folder})}."""
    import transformers as tf

    torch.set_num_threads(1)
    out = {}
    for name, (build, scoring) in MODELS.items():
        root = tmp_path_factory.mktemp(name)
        torch.manual_seed(8)
        model = build(tf).eval()
        with torch.no_grad():  # larger weights than the init, random norms and correction biases: far from uniform
            for p in model.parameters():
                p.mul_(4.0) if p.dim() > 1 else p.normal_(1.0, 0.3)
            for bname, b in model.named_buffers():
                if bname.endswith("e_score_correction_bias"):
                    b.normal_(0.0, 0.3)
            want = model(TOKENS[None]).logits[0]  # [T, vocab]
        model.save_pretrained(root / "hf")
        imported = {}
        for file, (qtype, split) in FILES.items():
            folder = root / file
            folder.mkdir()
            write_deepseek_gguf(root / "hf", root / f"{file}.gguf", qtype, split, scoring)
            convert_gguf(root / f"{file}.gguf", folder, log=lambda line: None, weights=False)
            os.link(root / f"{file}.gguf", folder / "original.gguf")
            imported[file] = folder
        out[name] = root / "hf", want, imported
    return out


@pytest.mark.parametrize("name", MODELS)
def test_the_config_is_the_checkpoints(models, name):
    hf, _, imported = models[name]
    want = json.loads((hf / "config.json").read_text())
    for file in ("F32-split", "F32-whole"):
        config = json.loads((imported[file] / "config.json").read_text())
        for key in ("architectures", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                    "v_head_dim",
                    "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size",
                    "first_k_dense_replace", "routed_scaling_factor", "n_group", "topk_group", "intermediate_size"):
            assert config.get(key) == want.get(key), (file, key)
        assert bool(config["norm_topk_prob"]) == bool(want.get("norm_topk_prob")) == (name == "v3")
        assert config["topk_method"] == want.get("topk_method", "noaux_tc")
    source = load_decoder(hf, "cpu", torch.float32, shapes_only=True)
    assert load_decoder(imported["F32-split"], "cpu", torch.float32, shapes_only=True).config == source.config


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("file", ["F32-split", "F32-whole"])
def test_a_float_gguf_is_the_safetensors_model_and_transformers(models, name, file):
    hf, want, imported = models[name]
    model, source = load_decoder(imported[file], "cpu", torch.float32), load_decoder(hf, "cpu", torch.float32)
    for cuts in CUTS.values():
        got = logits_in_steps(model, TOKENS, cuts)
        assert torch.equal(got, logits_in_steps(source, TOKENS, cuts))
        assert torch.allclose(got, want, atol=2e-5 * float(want.abs().max()), rtol=1e-4), (got - want).abs().max()


def test_the_split_kv_b_is_joined_head_by_head(models):
    """attn_k_b [H, r, dn] and attn_v_b [H, dv, r] back into transformers' kv_b_proj [H (dn + dv), r]."""
    from safetensors.torch import load_file

    hf, _, imported = models["v3"]
    index = GGUFIndex.open(imported["F32-split"] / "original.gguf")
    assert "blk.1.attn_kv_b.weight" not in index.tensors and index.tensors["blk.1.attn_k_b.weight"].shape == (4, 32, 32)
    joined = gguf_deepseek.tensors(index, lambda n: n)["model.layers.1.self_attn.kv_b_proj.weight"]
    want = load_file(str(hf / "model.safetensors"))["model.layers.1.self_attn.kv_b_proj.weight"]
    assert joined.shape == tuple(want.shape) == (4 * 64, 32)
    assert torch.equal(torch.from_numpy(joined.data), want)


@pytest.mark.parametrize("name", MODELS)
def test_q8_0_experts_run_on_their_own_blocks_and_speculation_is_exact(models, name):
    from outrider.kernels.quant_linear import QuantLinear

    folder = models[name][2]["Q8_0-split"]
    model = load_decoder(folder, "cpu", "gguf")
    moe = model.layers[1].moe
    assert model.layers[0].moe is None and moe.router.dtype == torch.float32
    assert isinstance(moe.gate_up[0], QuantLinear) and isinstance(moe.down[-1], QuantLinear)
    assert isinstance(moe.shared_gate_up, QuantLinear)
    got = logits_in_steps(model, TOKENS, CUTS["whole"])  # the same blocks dequantized, in another summation order
    want = logits_in_steps(load_decoder(folder, "cpu", torch.float32), TOKENS, CUTS["whole"])
    assert torch.allclose(got, want, atol=1e-4 * float(want.abs().max())), (got - want).abs().max()
    requests = [Request(PROMPT, 16, SamplingParams(0.0)), Request(PROMPT[::-1], 12, SamplingParams(0.0))]
    plain = [f.token_ids for f in generate_ids(model, requests, set())]
    assert len(set(plain[0])) > 3
    for drafter, tree in (("suffix", "chain"), (f"draft-model:{folder}", "static:2,2,1")):
        spec = Speculator.build(SpecOptions(drafter, tree, "fixed:3"), model, folder)
        assert [f.token_ids for f in generate_ids(model, requests, set(), speculation=spec)] == plain


def test_what_the_file_cannot_say_is_refused(models):
    index = GGUFIndex.open(models["v2"][2]["F32-split"] / "original.gguf")
    shapes = {n: t.shape for n, t in index.tensors.items()}
    for change, words in (({"deepseek2.rope.scaling.type": "yarn"}, "rope scaling 'yarn'"),
                          ({"deepseek2.expert_gating_func": 3}, "expert_gating_func 3"),
                          ({"deepseek2.attention.key_length_mla": 40}, "shapes disagree")):
        with pytest.raises(ModelError, match=words) as err:
            gguf_deepseek.config({**index.meta, **change}, shapes, {})
        assert "\n" not in str(err.value)
    half = {n: t for n, t in index.tensors.items() if n != "blk.2.attn_v_b.weight"}
    with pytest.raises(ModelError, match="blk.2|layer 2"):
        gguf_deepseek.tensors(type("Index", (), {"meta": index.meta, "tensors": half})(), lambda n: n)


def test_a_deepseek_gguf_is_read_in_place_not_converted(models, tmp_path):
    with pytest.raises(ModelError, match="read in place"):
        convert_gguf(models["v3"][2]["F32-split"] / "original.gguf", tmp_path / "out", log=lambda line: None)

