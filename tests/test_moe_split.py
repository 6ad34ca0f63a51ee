"""A dense model's FFNs split into experts (train/moe_split.py, train/moe_checkpoint.py; issue 41
item 2), on tiny random Llama and Qwen2 models: the Qwen2-MoE checkpoint transformers loads equals
the dense model with every expert active (router zeroed: up to float summation order; the fitted
router: within its weights' ripple), with and without a shared expert; bad splits refused."""

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from outrider.errors import ConfigError
from outrider.train.moe_checkpoint import Split, moe_config, moe_tensors
from outrider.train.moe_split import collect, make_split

E = 4
SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rope_theta=10000.0)


def _dense(kind):
    torch.manual_seed(0)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**SMALL, tie_word_embeddings=True))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**SMALL, tie_word_embeddings=False))
        for layer in model.model.layers:  # Qwen2's q/k/v biases start at zero: make them count
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.data.normal_()
    for p in model.parameters():  # larger than the init's 0.02 so the experts' shares differ
        p.data.mul_(5) if p.ndim == 2 else None
    raw = json.loads(model.config.to_json_string())
    raw["architectures"] = [type(model).__name__]
    return model.eval(), raw


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def case(request, tmp_path_factory):
    model, raw = _dense(request.param)
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    dense = {k: v.detach().clone() for k, v in model.state_dict().items()}
    xs = collect(model, tokens)
    with torch.no_grad():
        ref = model(tokens).logits
    return model, raw, dense, xs, tokens, ref, tmp_path_factory.mktemp(request.param)


def _moe(root, raw, dense, split, k):
    root.mkdir(exist_ok=True)
    save_file(moe_tensors(dense, raw, split), str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps(moe_config(raw, split.experts, k, split.shared)))
    return AutoModelForCausalLM.from_pretrained(root, dtype=torch.float32).eval()


@pytest.mark.parametrize("shared", [0, 16])  # expert sizes 20 and 16: transformers' grouped_mm wants rows of 16 bytes
def test_every_expert_active_is_the_dense_model(case, shared):
    _, raw, dense, xs, tokens, ref, tmp = case
    split, figures = make_split(dense, raw, xs, E, spread=1e-3, seed=0, shared=shared, iters=4, log=lambda s: None)
    assert len(figures) == 2 and all(0 < f["mass_top2"] <= f["oracle_top2"] + 1e-6 for f in figures)
    moe = _moe(tmp / f"s{shared}", raw, dense, split, k=E)
    assert type(moe).__name__ == "Qwen2MoeForCausalLM"
    with torch.no_grad():
        fitted = moe(tokens).logits
        for layer in moe.model.layers:  # softmax of zeros: every weight exactly 1/E
            layer.mlp.gate.weight.data.zero_()
        zeroed = moe(tokens).logits
    scale = ref.abs().max()
    assert (zeroed - ref).abs().max() <= 2e-6 * scale  # only the float summation order differs
    assert (fitted - ref).abs().max() <= 5e-3 * scale  # the fitted router's weights: 1 +- ~1e-3
    assert torch.equal(zeroed.argmax(-1), ref.argmax(-1)) and torch.equal(fitted.argmax(-1), ref.argmax(-1))


def test_fewer_experts_drop_some_and_differ(case):
    _, raw, dense, xs, tokens, ref, tmp = case
    split, _ = make_split(dense, raw, xs, E, spread=1e-3, seed=0, iters=4, log=lambda s: None)
    moe = _moe(tmp / "k1", raw, dense, split, k=1)
    with torch.no_grad():
        assert (moe(tokens).logits - ref).abs().max() > 1e-3 * ref.abs().max()


def test_bad_splits_refused(case):
    _, raw, dense, *_ = case
    L, I, H = 2, SMALL["intermediate_size"], SMALL["hidden_size"]
    perm = torch.arange(I).repeat(L, 1)
    perm[0, 0] = 1  # neuron 0 missing, neuron 1 twice
    with pytest.raises(ConfigError, match="not a permutation"):
        moe_tensors(dense, raw, Split(perm, torch.zeros(L, E, H)))
    with pytest.raises(ConfigError, match="do not divide"):
        moe_config(raw, 3, 2)
    with pytest.raises(ConfigError, match="cannot be split"):
        moe_config({**raw, "architectures": ["GPT2LMHeadModel"]}, E, 2)
