"""The native decoder layer (kernels/decoder_layer.py + decoder_layer.c) against the torch layer it
replaces for forwards that ask for logits: the same logits, hidden states and K/V up to float
rounding for each family (Llama, Qwen2 with q/k/v biases, Qwen3 with q/k norms), ragged batches,
slots out of order and tree masks; each row's result bit-identical whatever the other rows; and
greedy speculative output equal to autoregressive output with it. On every variant of the library
this machine executes (kernel_variants.py; greedy speculation on the default and portable)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.kernels import native
from outrider.models.batch import pack
from outrider.weights.loader import load_decoder
from outrider.sampling import SamplingParams
from outrider.engine.speculator import SpecOptions, Speculator
from kernel_variants import ALL, I8, TWO, variant  # noqa: F401  (variant: the fixture)

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernel: {native.reason()}")


def make_family(family: str, folder: Path, seed: int = 0) -> Path:
    """A tiny random model of `family` whose projections all take a multiple of 32 inputs."""
    import transformers as tf

    common = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    config, cls = {"llama": (lambda: tf.LlamaConfig(**common), tf.LlamaForCausalLM),
                   # head size 64, two query heads a kv head: the AVX-512 path that weighs values for several heads at once
                   "llama-d64": (lambda: tf.LlamaConfig(**{**common, "hidden_size": 128, "num_attention_heads": 2,
                                                           "num_key_value_heads": 1}), tf.LlamaForCausalLM),
                   # 3 and 6 query heads a kv head: attention's tiles of 3 heads (test_attention_lanes.py)
                   "llama-g3": (lambda: tf.LlamaConfig(**{**common, "hidden_size": 192, "num_attention_heads": 6,
                                                          "num_key_value_heads": 2}), tf.LlamaForCausalLM),
                   "llama-g6": (lambda: tf.LlamaConfig(**{**common, "hidden_size": 384, "num_attention_heads": 6,
                                                          "num_key_value_heads": 1}), tf.LlamaForCausalLM),
                   "qwen2": (lambda: tf.Qwen2Config(**common, rope_theta=1e6), tf.Qwen2ForCausalLM),
                   "qwen3": (lambda: tf.Qwen3Config(**common, head_dim=32, rope_theta=1e6), tf.Qwen3ForCausalLM)}[family]
    torch.manual_seed(seed)
    model = cls(config()).eval()
    with torch.no_grad():  # weights larger than the init, so logits are far from uniform
        for name, p in model.named_parameters():
            p.mul_(4.0 if p.dim() > 1 else 1.0)
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=["llama", "llama-d64", "qwen2", "qwen3"])
def model(request, tmp_path_factory):
    folder = make_family(request.param, tmp_path_factory.mktemp("native") / request.param)
    return load_decoder(folder, "cpu", "q4"), folder


def run(m, native_on: bool, steps):
    """A prefill of two prompts (torch path: no logits), then `steps` forwards (slots, lengths,
    tokens, parents) with logits; returns their logits, a tapped hidden state and the cache."""
    saved = m._native
    m.forward(pack([0], [0], [torch.tensor([5])], logits="none", scratch_row=0), m.new_cache(1, 4))  # choose paths
    native_layers = m._native if m._native is not None else saved
    m._native = native_layers if native_on else None
    cache = m.new_cache(3, 64)
    prompts = {0: [3, 9, 4, 11, 7, 8, 20], 2: [6, 5, 30, 31]}
    for slot, toks in prompts.items():
        m.forward(pack([slot], [0], [torch.tensor(toks)], logits="none", scratch_row=cache.scratch_row), cache)
    out = []
    for slots, lens, toks, parents in steps:
        batch = pack(slots, lens, [torch.tensor(t) for t in toks], parents, scratch_row=cache.scratch_row,
                     hidden_layers=(1, 3))
        got = m.forward(batch, cache)
        out.append((got.logits, got.hidden[1], got.hidden[3]))
    m._native = native_layers
    return out, cache


STEPS = [
    ([0], [7], [[12]], None),  # one decode step
    ([2, 0], [4, 8], [[13, 14, 15], [16]], None),  # ragged, slots out of order
    ([0, 2], [9, 7], [[17, 18, 19, 21], [22, 23, 24]],  # trees
     [torch.tensor([-1, 0, 0, 1]), torch.tensor([-1, 0, 1])]),
]


@pytest.mark.parametrize("variant", ALL, indirect=True)
def test_native_layer_matches_the_torch_layer(model, variant):
    m, _ = model
    fast, cache_fast = run(m, True, STEPS)
    assert m._native is not None  # every projection is a native QuantLinear: the path is taken
    slow, cache_slow = run(m, False, STEPS)
    for (a, ha, hb), (b, hc, hd) in zip(fast, slow):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4), (a - b).abs().max()
        assert torch.allclose(ha, hc, rtol=1e-4, atol=1e-4) and torch.allclose(hb, hd, rtol=1e-4, atol=1e-4)
    for layer in range(len(m.layers)):
        assert torch.allclose(cache_fast.k[layer], cache_slow.k[layer], rtol=1e-4, atol=1e-5)
        assert torch.allclose(cache_fast.v[layer], cache_slow.v[layer], rtol=1e-4, atol=1e-5)


def test_one_call_for_the_layers_between_taps_equals_a_call_a_layer(model, monkeypatch):
    """NativeLayers.run (one native call for the layers between two hidden-state taps) gives the
    logits, taps and cache that run_one (a call a layer) gives, bit for bit."""
    from outrider.kernels.decoder_layer import NativeLayers

    m, _ = model
    spans, cache_spans = run(m, True, STEPS)
    monkeypatch.setattr(NativeLayers, "run", NativeLayers.run_one)
    ones, cache_ones = run(m, True, STEPS)
    for got, want in zip(spans, ones):
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    for layer in range(len(m.layers)):
        assert torch.equal(cache_spans.k[layer], cache_ones.k[layer])
        assert torch.equal(cache_spans.v[layer], cache_ones.v[layer])


@pytest.mark.parametrize("variant", ALL, indirect=True)
def test_a_rows_result_does_not_depend_on_the_others(model, variant):
    """Four tokens verified in one forward (beside another slot's rows) give each row the logits
    four one-token steps give, bit for bit: the premise of lossless speculation here."""
    m, _ = model
    toks = [12, 40, 41, 42]
    together, _ = run(m, True, [([0, 2], [7, 4], [toks, [50, 51]], None)])
    alone, _ = run(m, True, [([0], [7 + i], [[t]], None) for i, t in enumerate(toks)])
    for i in range(4):
        assert torch.equal(together[0][0][0, i], alone[i][0][0, 0])


@pytest.mark.parametrize("dtype,variant", [pytest.param("q4", v.values[0], id=f"q4-{v.id}") for v in ALL]
                         + [pytest.param("q4-i8", *v.values, id=f"q4-i8-{v.id}", marks=v.marks) for v in I8],
                         indirect=["variant"])
def test_a_tree_node_gets_what_its_path_decoded_a_token_a_step_gets(model, dtype, variant):
    """A tree verified in one forward gives each node, bit for bit, the logits its root-to-node
    path gets decoded one token a step: its ancestors' keys sit at cache rows with gaps between
    them, and attention must sum over them as over consecutive rows. (With int8 activations a
    last-bit difference upstream can move a code, and the logits by far more.)"""
    _, folder = model
    m = load_decoder(folder, "cpu", dtype)
    prompt, toks = [3, 9, 4, 11, 7, 8, 20], [12, 40, 41, 42, 43, 44, 45]
    parents = [-1, 0, 0, 1, 2, 3, 1]

    def prefilled():
        cache = m.new_cache(1, 32)
        m.forward(pack([0], [0], [torch.tensor(prompt)], logits="none", scratch_row=cache.scratch_row), cache)
        return cache

    cache = prefilled()
    tree = m.forward(pack([0], [len(prompt)], [torch.tensor(toks)], [torch.tensor(parents)],
                          scratch_row=cache.scratch_row), cache).logits[0]
    for node in range(len(toks)):
        path, j = [], node
        while j >= 0:
            path.insert(0, j)
            j = parents[j]
        cache = prefilled()
        for depth, k in enumerate(path):
            step = m.forward(pack([0], [len(prompt) + depth], [torch.tensor([toks[k]])],
                                  scratch_row=cache.scratch_row), cache).logits[0, -1]
        assert torch.equal(step, tree[node]), (node, path)


@pytest.mark.parametrize("variant", TWO, indirect=True)
def test_greedy_speculative_equals_autoregressive(model, variant):
    m, folder = model
    requests = [Request([3, 9, 4, 3, 9, 4, 3, 9], 24, SamplingParams(0.0)), Request([7, 8, 7, 8, 7], 24, SamplingParams(0.0))]
    plain = [f.token_ids for f in generate_ids(m, requests, set())]
    spec = Speculator.build(SpecOptions("ngram", "chain", "fixed:4"), m, folder)
    fast = generate_ids(m, requests, set(), speculation=spec)
    assert [f.token_ids for f in fast] == plain
    assert sum(f.round_stats.committed for f in fast) > sum(f.round_stats.rounds for f in fast)  # drafts were accepted
