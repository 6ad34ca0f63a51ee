"""The MoE MLP's expert product (moe_layer.moe_mlp: a forward's rows grouped by expert, each chosen
expert multiplied once on the rows that chose it) against its slow reference
(moe_mlp_per_token: every row's every choice alone), on random weights, float and q8_0, for the
routers the families use (softmax renormalised or not, DeepSeek-V3's sigmoid with a bias and
groups, a gated shared expert), at one row, a verify's rows and a prefill's; and the count: a
k-token verify reads each chosen expert once, the reference once per row that chose it. And
transformers' own Mixtral, Qwen3-MoE and OLMoE sparse blocks in bfloat16 give moe_mlp's bits."""

from __future__ import annotations

import pytest
import torch

from outrider.kernels.blocks import quantize
from outrider.kernels.quant_linear import QuantLinear
from outrider.models import moe_layer
from outrider.models.moe_config import MoeConfig
from outrider.models.moe_layer import MoeWeights, moe_mlp, moe_mlp_per_token

E, I, N = 64, 32, 8
CONFIGS = {
    "softmax, renormalised": MoeConfig(num_experts=N, top_k=2, expert_size=I, norm_topk_prob=True),
    "softmax, top 3 as chosen": MoeConfig(num_experts=N, top_k=3, expert_size=I, norm_topk_prob=False),
    "sigmoid, bias, groups": MoeConfig(num_experts=N, top_k=3, expert_size=I, norm_topk_prob=True, scoring="sigmoid",
                                       n_group=4, topk_group=2, group_score="top2", score_bias=True, routed_scale=2.5),
    "gated shared expert": MoeConfig(num_experts=N, top_k=2, expert_size=I, norm_topk_prob=False, shared_size=64,
                                     shared_gate=True),
}


def weights(cfg: MoeConfig, quantized: bool) -> MoeWeights:
    g = torch.Generator().manual_seed(1)
    rand = lambda *shape: torch.randn(*shape, generator=g) * 0.3  # noqa: E731
    mat = (lambda t: QuantLinear(quantize(t, "q8_0"))) if quantized else (lambda t: t)  # noqa: E731
    shared = {}
    if cfg.shared_size:
        shared = dict(shared_gate_up=mat(rand(2 * cfg.shared_size, E)), shared_down=mat(rand(E, cfg.shared_size)),
                      shared_gate=rand(1, E) if cfg.shared_gate else None)
    return MoeWeights(router=rand(N, E) * 4, gate_up=[mat(rand(2 * I, E)) for _ in range(N)],
                      down=[mat(rand(E, I)) for _ in range(N)],
                      score_bias=rand(N) if cfg.score_bias else None, **shared)


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "q8_0"])
@pytest.mark.parametrize("name", CONFIGS)
def test_grouped_by_expert_is_the_per_token_product(name, quantized):
    cfg = CONFIGS[name]
    w = weights(cfg, quantized)
    for rows in (1, 5, 40):  # a decode step, a verify's rows, a prefill
        x = torch.randn(1, rows, E, generator=torch.Generator().manual_seed(rows))  # [B, T, E]
        got, want = moe_mlp(w, cfg, x), moe_mlp_per_token(w, cfg, x)
        assert got.shape == want.shape == x.shape
        assert torch.allclose(got, want, atol=1e-5 * float(want.abs().max()), rtol=1e-4), (got - want).abs().max()


def test_a_verify_reads_each_chosen_expert_once(monkeypatch):
    cfg = CONFIGS["softmax, renormalised"]
    w = weights(cfg, False)
    x = torch.randn(1, 8, E, generator=torch.Generator().manual_seed(3))  # an 8-token verify
    _, experts = moe_layer.route(x[0], w.router, cfg)  # [8, 2]
    reads = []
    real = moe_layer.swiglu_mlp
    monkeypatch.setattr(moe_layer, "swiglu_mlp", lambda h, gate_up, down: reads.append(id(gate_up)) or real(h, gate_up, down))
    moe_mlp(w, cfg, x)
    chosen = {id(w.gate_up[e]) for e in experts.reshape(-1).tolist()}
    assert sorted(reads) == sorted(chosen) and len(chosen) < 16  # each chosen expert once
    reads.clear()
    moe_mlp_per_token(w, cfg, x)
    assert len(reads) == 16  # the reference: once per row and choice


def test_the_comparison_catches_a_lost_weight(monkeypatch):
    """A grouped product that drops the routing weights fails the comparison."""
    cfg = CONFIGS["softmax, top 3 as chosen"]
    w = weights(cfg, False)
    x = torch.randn(1, 5, E, generator=torch.Generator().manual_seed(5))
    want = moe_mlp_per_token(w, cfg, x)
    real = moe_layer.route
    monkeypatch.setattr(moe_layer, "route", lambda *a, **k: (torch.ones_like(real(*a, **k)[0]), real(*a, **k)[1]))
    assert not torch.allclose(moe_mlp(w, cfg, x), want, atol=1e-4)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "olmoe"])
def test_a_bfloat16_block_is_transformers_bit_for_bit(family):
    """transformers' sparse MoE blocks in bfloat16 against moe_mlp with the family's MoeConfig:
    the same bits (Mixtral keeps its weights float32 until each expert's output is weighted:
    weights_float32; rounded to bfloat16 first, the outputs differ)."""
    import dataclasses

    import transformers as tf

    from outrider.models import mixtral, olmoe, qwen3_moe

    sizes = dict(hidden_size=E, num_experts_per_tok=2)
    config, module = {
        "mixtral": (tf.MixtralConfig(**sizes, intermediate_size=I, num_local_experts=N), mixtral),
        "qwen3_moe": (tf.Qwen3MoeConfig(**sizes, moe_intermediate_size=I, num_experts=N, norm_topk_prob=True), qwen3_moe),
        "olmoe": (tf.OlmoeConfig(**sizes, intermediate_size=I, num_experts=N), olmoe),
    }[family]
    blocks = {"mixtral": "MixtralSparseMoeBlock", "qwen3_moe": "Qwen3MoeSparseMoeBlock", "olmoe": "OlmoeSparseMoeBlock"}
    modeling = getattr(tf.models, family)
    torch.manual_seed(2)
    block = getattr(getattr(modeling, f"modeling_{family}"), blocks[family])(config).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.3)
    block = block.to(torch.bfloat16)
    x = torch.randn(1, 40, E, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    with torch.no_grad():
        want = block(x)
    experts = block.experts
    w = MoeWeights(router=block.gate.weight.data, gate_up=list(experts.gate_up_proj.data.unbind(0)),
                   down=list(experts.down_proj.data.unbind(0)))
    cfg = module.FAMILY.moe({**config.to_dict(), "num_hidden_layers": 1})
    assert torch.equal(moe_mlp(w, cfg, x), want)
    if family == "mixtral":
        assert not torch.equal(moe_mlp(w, dataclasses.replace(cfg, weights_float32=False), x), want)
