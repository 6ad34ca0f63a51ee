"""Qwen3-Next from a GGUF (llama.cpp's architecture `qwen3next`): a tiny all-MoE Qwen3-Next saved by
transformers, written in the converter's layout (tests/qwen35_gguf.py: in_proj_qkvz split into
attn_qkv and attn_gate, in_proj_ba kept grouped, the experts stacked in 3-D; checked against the
real converter by scripts/check_qwen35_gguf_layout.py), read back: the safetensors load's logits
bit for bit, the file's own blocks kept, speculation exact."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.models.batch import pack
from outrider.sampling import SamplingParams
from outrider.weights.gguf_convert import convert_gguf
from outrider.weights.loader import load_decoder
from qwen35_gguf import write_qwen35_gguf
from tiny import make_tiny

TOKENS = torch.tensor([3, 9, 4, 11, 7, 8, 20, 5, 3, 9, 60, 61, 62, 63, 12, 30, 31, 2, 9, 4])
PROMPT = [5, 17, 33, 8, 5, 17, 33, 9, 40, 41]


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """Every MLP sparse (the converter has no names for a dense one in qwen3next), over the BPE's
    264 tokens; norms, A_log and dt_bias drawn at random."""
    folder = make_tiny("qwen3_next", tmp_path_factory.mktemp("next-gguf") / "hf", vocab=264, layers=4,
                       mlp_only_layers=[])
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    g = torch.Generator().manual_seed(7)
    for name, t in tensors.items():
        if t.dim() == 1:
            tensors[name] = torch.randn(t.shape, generator=g) * 0.3
    save_file(tensors, str(path), metadata={"format": "pt"})
    return folder


def imported(hf, root, qtype: str):
    folder = root / qtype
    folder.mkdir()
    write_qwen35_gguf(hf, root / f"{qtype}.gguf", qtype)
    convert_gguf(root / f"{qtype}.gguf", folder, log=lambda line: None, weights=False)
    os.link(root / f"{qtype}.gguf", folder / "original.gguf")
    return folder


def logits(model) -> torch.Tensor:
    cache = model.new_cache(1, 32)
    return model.forward(pack([0], [0], [TOKENS], scratch_row=cache.scratch_row), cache).logits[0]


def test_a_float_gguf_is_the_safetensors_model_bit_for_bit(hf, tmp_path):
    folder = imported(hf, tmp_path, "F32")
    config = json.loads((folder / "config.json").read_text())
    want = json.loads((hf / "config.json").read_text())
    for key in ("architectures", "layer_types", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                "shared_expert_intermediate_size", "mlp_only_layers", "norm_topk_prob"):
        assert config[key] == want[key], key
    model = load_decoder(folder, "cpu", torch.float32)
    assert model.config.mlp_kinds == ("moe",) * 4
    assert torch.equal(logits(model), logits(load_decoder(hf, "cpu", torch.float32)))


def test_q8_0_experts_run_on_their_own_blocks_and_speculation_is_exact(hf, tmp_path):
    """The converter's --outtype q8_0: every expert, the shared expert and the gated-delta
    projections in Q8_0 (the routers F32): within float rounding of the same file's values, and
    greedy decoding with suffix drafts equals plain."""
    from outrider.kernels.quant_linear import QuantLinear

    folder = imported(hf, tmp_path, "Q8_0")
    model = load_decoder(folder, "cpu", "gguf")
    moe = model.layers[0].moe
    assert isinstance(moe.gate_up[0], QuantLinear) and isinstance(moe.down[7], QuantLinear)
    got, want = logits(model), logits(load_decoder(folder, "cpu", torch.float32))
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    requests = [Request(PROMPT, 16, SamplingParams(0.0)), Request(PROMPT[::-1], 12, SamplingParams(0.0))]
    plain = [f.token_ids for f in generate_ids(model, requests, set())]
    spec = Speculator.build(SpecOptions("suffix", "chain", "fixed:4"), model, folder)
    assert [f.token_ids for f in generate_ids(model, requests, set(), speculation=spec)] == plain
