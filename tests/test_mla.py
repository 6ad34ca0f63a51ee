"""Latent attention (models/latent_layer.py) against transformers' own implementations: small random
`DeepseekV2ForCausalLM`s (queries in one q_proj, and through a q LoRA with YaRN RoPE and its
mscale) and a `MiniCPM3ForCausalLM` (RoPE on halves, scaled embeddings, residual branches and
logits) give transformers' logits (a whole prefill, a chunked one, decode steps) and greedy tokens;
the plain and absorbed forms give the same logits on the same batches; the cache keeps r + dr
values a token and layer; greedy speculation equals plain decoding (a lookup chain, a draft-model
tree, an early-exit tree over the target's own latent cache); and the checks fail with DeepSeek's
interleaved RoPE read as halves, YaRN's mscale left out of the scale, or MiniCPM3's residual
scale dropped."""

from __future__ import annotations


import pytest
import torch

from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.errors import ConfigError
from outrider.models import latent_layer
from outrider.models.latent_cache import LatentCache
from outrider.sampling import SamplingParams
from outrider.weights import latent_load
from outrider.weights.loader import load_decoder
from tiny import add_tokenizer, logits_in_steps, saved_references

TOKENS = torch.randint(3, 96, (48,), generator=torch.Generator().manual_seed(1))
PROMPT = [5, 17, 33, 8, 5, 17, 33, 9, 40, 41, 42, 43, 44, 5, 17, 33, 8, 5, 17]
YARN = {"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 0.7, "mscale_all_dim": 0.9, "beta_fast": 32, "beta_slow": 1}
# MiniCPM3-4B's own RoPE type (its original length is its whole context); factor 2: cos / sin scaled
LONGROPE = {"rope_type": "longrope", "rope_theta": 100.0, "factor": 2.0, "original_max_position_embeddings": 256,
            "short_factor": [1.0, 1.4, 2.3, 3.9], "long_factor": [1.0, 4.0, 8.0, 16.0]}
SIZES = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
             kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, max_position_embeddings=256,
             bos_token_id=1, eos_token_id=2, pad_token_id=0)
MODELS = {
    "deepseek_v2": lambda tf: tf.DeepseekV2ForCausalLM(tf.DeepseekV2Config(
        **SIZES, q_lora_rank=None, first_k_dense_replace=2, rope_parameters={"rope_type": "default", "rope_theta": 100.0})),
    "deepseek_v2-qlora-yarn": lambda tf: tf.DeepseekV2ForCausalLM(tf.DeepseekV2Config(
        **SIZES, q_lora_rank=20, first_k_dense_replace=2, rope_parameters=YARN)),
    "minicpm3": lambda tf: tf.MiniCPM3ForCausalLM(tf.MiniCPM3Config(
        **SIZES, q_lora_rank=20, num_key_value_heads=4, rope_parameters=LONGROPE)),
}


def save(name, folder):
    import transformers as tf

    torch.manual_seed(1)
    model = MODELS[name](tf).eval()
    with torch.no_grad():  # larger weights than the init, and random norms, so that logits are far from uniform
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else p.normal_(1.0, 0.3)
    model.save_pretrained(folder)
    add_tokenizer(folder)
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return saved_references(tmp_path_factory, MODELS, save, TOKENS)



CUTS = {"whole": [0, 48], "chunked": [0, 13, 30, 48], "decode": [0, 40, *range(41, 49)]}


def close(got, want) -> bool:
    return torch.allclose(got, want, atol=2e-5 * float(want.abs().max()), rtol=1e-4)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("cuts", CUTS)
def test_logits_match_transformers(models, name, cuts):
    got, want = logits_in_steps(models[name][3], TOKENS, CUTS[cuts]), models[name][2]
    assert close(got, want), (got - want).abs().max()


@pytest.mark.parametrize("name", MODELS)
def test_plain_and_absorbed_forms_agree(models, name, monkeypatch):
    """Each form alone on the same batches (a whole prefill takes the plain form by default, a
    13-row chunk and a decode step the absorbed one: both are exercised above too)."""
    model = models[name][3]
    m = model.config.mla
    assert not latent_layer.absorbed_form(48, m) and latent_layer.absorbed_form(13, m)
    got = {}
    for form in (True, False):
        monkeypatch.setattr(latent_layer, "absorbed_form", lambda rows, mla, form=form: form)
        got[form] = logits_in_steps(model, TOKENS, CUTS["chunked"])
    assert close(got[True], got[False]) and close(got[True], models[name][2])


def test_config_and_cache_bytes(models):
    c = models["deepseek_v2-qlora-yarn"][3].config
    assert (c.mla.q_rank, c.mla.kv_rank, c.mla.rope_dim, c.mla.interleaved) == (20, 24, 8, True)
    assert (c.num_kv_heads, c.head_dim, c.rotary) == (1, 24, 8)
    assert c.mla.scale == pytest.approx(24 ** -0.5 * (0.1 * 0.9 * torch.log(torch.tensor(4.0)).item() + 1) ** 2)
    mc = models["minicpm3"][3].config
    assert not mc.mla.interleaved and mc.embed_multiplier == 12 and mc.logit_divisor == 0.25
    assert mc.residual_scale == pytest.approx(1.4 / 2 ** 0.5)
    cache = models["minicpm3"][3].new_cache(2, 31)
    assert isinstance(cache, LatentCache) and cache.bytes_per_token() == 2 * (24 + 8) * 4
    assert cache.nbytes() == 2 * 32 * cache.bytes_per_token()  # 2 slots x 32 rows (31 + the scratch row)
    assert models["minicpm3"][3].new_cache(1, 31, num_layers=1).bytes_per_token() == (24 + 8) * 4


@pytest.mark.parametrize("name", ["deepseek_v2", "minicpm3"])
def test_greedy_tokens_match_transformers(models, name):
    reference, model = models[name][1], models[name][3]
    out = reference.generate(torch.tensor([PROMPT]), max_new_tokens=30, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    plain = generate_ids(model, [Request(PROMPT, 30, SamplingParams(0.0))], set())[0].token_ids
    assert plain == out[0, len(PROMPT):].tolist()
    assert len(set(plain)) > 5


@pytest.mark.parametrize("name", ["deepseek_v2-qlora-yarn", "minicpm3"])
@pytest.mark.parametrize("drafter, tree, control", [
    ("suffix", "chain", "fixed:6"),
    ("draft-model", "static:2,2,1,1", "fixed:4"),  # the model drafts itself: trees accepted deep
    ("early-exit:1", "static:2,2,1", "fixed:3"),  # over the target's own latent cache
])
def test_speculation_is_exact(models, name, drafter, tree, control):
    folder, model = models[name][0], models[name][3]
    requests = [Request(PROMPT, 30, SamplingParams(0.0)), Request(PROMPT[3:] + [60, 61], 23, SamplingParams(0.0))]
    plain = [c.token_ids for c in generate_ids(model, requests, set())]
    spec = f"draft-model:{folder}" if drafter == "draft-model" else drafter
    speculator = Speculator.build(SpecOptions(spec, tree, control), model, folder)
    done = generate_ids(model, requests, set(), speculation=speculator)
    assert [c.token_ids for c in done] == plain
    if drafter == "draft-model":  # its trees' paths were accepted deep: the compaction of latent rows ran
        assert done[0].stats["mean_accepted_length"] > 2


@pytest.mark.parametrize("mutant", ["interleaved read as halves", "no mscale in the scale", "no residual scale"])
def test_the_checks_catch(models, mutant, monkeypatch):
    import dataclasses

    name = "minicpm3" if mutant == "no residual scale" else "deepseek_v2-qlora-yarn"
    folder, want = models[name][0], models[name][2]
    if mutant == "interleaved read as halves":
        monkeypatch.setattr(latent_load, "halves", lambda dim: torch.arange(dim))
    model = load_decoder(folder, "cpu", torch.float32)
    if mutant == "no mscale in the scale":
        model.config = dataclasses.replace(model.config, mla=dataclasses.replace(model.config.mla, scale=24 ** -0.5))
    elif mutant == "no residual scale":
        model.config = dataclasses.replace(model.config, residual_scale=1.0)
    assert not close(logits_in_steps(model, TOKENS, CUTS["chunked"]), want)


def test_sparsespec_refuses_a_latent_target(models):
    folder, model = models["deepseek_v2"][0], models["deepseek_v2"][3]
    with pytest.raises(ConfigError, match="latent-attention layers keep one latent row a token"):
        Speculator.build(SpecOptions("sparsespec:32,4,8", "chain", "fixed:3"), model, folder)


def test_quantized_projections_speculate_exactly(models):
    """--dtype q8_0: the projections quantized at load, kv_b_proj kept float for the absorption."""
    folder = models["deepseek_v2-qlora-yarn"][0]
    model = load_decoder(folder, "cpu", "q8_0")
    assert isinstance(model.layers[0].latent.kv_b, torch.Tensor) and not isinstance(model.layers[0].latent.in_proj, torch.Tensor)
    requests = [Request(PROMPT, 24, SamplingParams(0.0))]
    plain = [c.token_ids for c in generate_ids(model, requests, set())]
    speculator = Speculator.build(SpecOptions(f"draft-model:{folder}", "static:2,2,1", "fixed:3"), model, folder)
    assert [c.token_ids for c in generate_ids(model, requests, set(), speculation=speculator)] == plain
