"""SparseSpec-L (issue 26, item 3): `--drafter sparsespec[:BUDGET[,SINK[,RECENT]]]` and
`--controller entropy[:MAX]`.

The sparse draft's forwards equal a slow reference: full attention over the whole sequence from
an empty cache whose mask lets each query see, per K/V head and layer, only the kept keys (and the
drafts before it). The greedy output equals autoregressive output with budgets far below the
prompt (tiny models of each family, every tree shape, the entropy controller; SmolLM2-135M), the
target's cache is never written by the drafter, the selection comes back to dropped keys when
the queries move, and bad options are refused in one line before anything loads.
"""

from __future__ import annotations

import pytest
import torch
from enumerate_law import one_thread

from outrider.drafters.registry import parse_drafter
from outrider.drafters.sparsespec import SparseDrafter, Sparsity, select
from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.errors import ConfigError
from outrider.weights.loader import load_decoder

SHAPES = ["chain", "static:2,2,1", "dynamic:3,8"]


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    with one_thread():
        yield


def prompts():
    g = torch.Generator().manual_seed(5)
    base = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (1, 7, 60)]
    return base + [[10, 11, 12, 13, 14] * 12]  # a repeat, so the drafts are often right


def run(target, spec=None, n=16):
    requests = [Request(list(p), n) for p in prompts()]
    return [f.token_ids for f in generate_ids(target, requests, set(), speculation=spec)]


@pytest.fixture(scope="module")
def target(tiny_folders):
    return load_decoder(tiny_folders["llama"], "cpu")


@pytest.fixture(scope="module")
def plain(target):
    return run(target)


# -- lossless: greedy output is autoregressive output -------------------------------------------
@pytest.mark.parametrize("shape", SHAPES)
def test_sparsespec_greedy_equals_autoregressive(target, plain, tiny_folders, shape):
    spec = Speculator.build(SpecOptions("sparsespec:12,2,3", shape, "fixed:4"), target, tiny_folders["llama"])
    assert isinstance(spec.drafter, SparseDrafter) and spec.hidden_layers == (0, 1, 2)
    assert run(target, spec) == plain
    assert min(spec.drafter.kept_share) < 0.25  # the 60-token prompts kept 12 keys: sparsity applied


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_sparsespec_greedy_equals_autoregressive_in_other_families(tiny_folders, family):
    tgt = load_decoder(tiny_folders[family], "cpu")
    spec = Speculator.build(SpecOptions("sparsespec:10,1,2", "chain", "entropy:5"), tgt, tiny_folders[family])
    assert run(tgt, spec) == run(tgt)


def test_the_entropy_controller_is_lossless_and_stops_early(target, plain, tiny_folders):
    spec = Speculator.build(SpecOptions("sparsespec:12,2,3", "chain", "entropy:6"), target, tiny_folders["llama"])
    assert run(target, spec, 16) == plain
    assert sum(spec.controller.seen) > 0  # it learned from the rounds
    sampled = Speculator.build(SpecOptions("early-exit:2", "chain", "entropy:6"), target, tiny_folders["llama"])
    assert run(target, sampled) == plain  # another model drafter that honours the stop


# -- the forwards against the slow reference ------------------------------------------------------
def reference_logits(target, sequence: list[int], start: int, kept: torch.Tensor) -> torch.Tensor:
    """Logits [n, vocab] of one forward over `sequence` from nothing, written out layer by layer:
    query i < start sees keys 0..i; query i >= start sees, in layer l and K/V head g, the keys at
    positions kept[l, g] and start..i."""
    from outrider.models.layers import apply_rotary, linear, rms_norm, rotary_tables, swiglu_mlp

    c = target.config
    H, G, D, n = c.num_heads, c.num_kv_heads, c.head_dim, len(sequence)
    cos, sin = rotary_tables(torch.arange(n).view(1, n), target.inv_freq, target.dtype)
    x = target.embed[torch.tensor(sequence)].unsqueeze(0)  # [1, n, E]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for index, w in enumerate(target.layers):
        h = rms_norm(x, w.input_norm, c.rms_norm_eps)
        qkv = linear(h, w.qkv, w.qkv_bias)[0]  # [n, (H + 2G) D]
        q = qkv[:, : H * D].view(n, H, D).transpose(0, 1).unsqueeze(0)
        k = qkv[:, H * D : (H + G) * D].view(n, G, D).transpose(0, 1).unsqueeze(0)
        if w.q_norm is not None:
            q, k = rms_norm(q, w.q_norm, c.rms_norm_eps), rms_norm(k, w.k_norm, c.rms_norm_eps)
        q, k = apply_rotary(q, cos, sin)[0], apply_rotary(k, cos, sin)[0]  # [H, n, D], [G, n, D]
        v = qkv[:, (H + G) * D :].view(n, G, D).transpose(0, 1)
        out = torch.zeros(H, n, D)
        for head in range(H):
            g = head // (H // G)
            mask = causal.clone()
            mask[start:, :start] = False
            mask[start:, kept[index, g]] = True
            scores = (q[head] @ k[g].T) / D ** 0.5
            out[head] = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ v[g]
        x = x + linear(out.transpose(0, 1).reshape(1, n, H * D), w.o)
        x = x + swiglu_mlp(rms_norm(x, w.post_norm, c.rms_norm_eps), w.gate_up, w.down)
    return linear(rms_norm(x, target.norm, c.rms_norm_eps), target.lm_head)[0].float()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_the_sparse_draft_equals_full_attention_over_the_kept_keys(tiny_folders, family):
    """A 50-token prompt in the target's cache, 10 keys kept: the drafts and the logits of the root
    and drafts equal the slow reference's, per layer and K/V head; the target's cache is untouched;
    and full attention differs, so the selection restricts something."""
    from outrider.drafters.grow import Feed
    from outrider.spec.types import Budget
    from outrider.models.batch import pack
    from outrider.spec.shapes import parse_shape

    target = load_decoder(tiny_folders[family], "cpu")
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 96, (50,), generator=g).tolist()
    cache = target.new_cache(1, 64)
    layers = tuple(range(target.config.num_layers))
    with torch.inference_mode():
        out = target.forward(pack([0], [0], [torch.tensor(prompt[:-1])], logits="none", hidden_layers=layers,
                                  scratch_row=cache.scratch_row), cache)
    cache.set_length(0, len(prompt) - 1)
    hidden = torch.stack([out.hidden[layer][0] for layer in layers], dim=1)  # [n, layers, E]
    drafter = SparseDrafter(target, parse_shape("chain"), Sparsity(10, 2, 3))
    drafter.attach_target_cache(cache)
    drafter.start(0, prompt, target_slot=0, hidden=hidden)
    kept = drafter._select(0, len(prompt) - 1)  # [layers, G, 10]
    assert kept.shape[-1] == 10 and not all(torch.equal(kept[0, 0], kept[i, j]) for i in layers
                                            for j in range(kept.shape[1]))  # chosen per layer and head
    before = [t.clone() for t in (*cache.k, *cache.v)]
    tree = drafter.propose(0, prompt, Budget(3, 3))
    assert all(torch.equal(a, b) for a, b in zip(before, (*cache.k, *cache.v)))
    sequence = prompt + tree.tokens[1:].tolist()
    with torch.inference_mode():
        ref = reference_logits(target, sequence, len(prompt) - 1, kept)
        for d in range(1, 4):
            assert tree.tokens[d] == int(ref[len(prompt) + d - 2].argmax())
        st = drafter._states[0]
        logits = drafter._forward([st], [Feed(tree.tokens.tolist(), tree.parents.tolist(), 0)])[0]
        assert torch.allclose(logits, ref[len(prompt) - 1 :], atol=1e-4)
        dense = reference_logits(target, sequence, len(prompt) - 1, torch.arange(len(prompt) - 1).expand(
            len(layers), kept.shape[1], -1))
        assert not torch.allclose(dense[len(prompt) - 1 :], logits, atol=1e-3)


def test_the_selection_recalls_a_dropped_key():
    """Keys chosen by the queries' attention, beside the sink and the recent: a key left out for
    one query comes back when a later query attends to it (the dense cache is never pruned)."""
    g = torch.Generator().manual_seed(0)
    keys = torch.nn.functional.normalize(torch.randn(2, 40, 64, generator=g), dim=-1)  # [G, L, D], nearly orthogonal
    sparsity = Sparsity(4, 1, 2)  # one key chosen a head

    def looking_at(j):  # 2 query heads a K/V head, one row, attending to key j
        return keys[:, j].repeat_interleave(2, 0).unsqueeze(1) * 8

    first = select(looking_at(10), keys, sparsity)
    assert first.tolist() == [[0, 10, 38, 39]] * 2
    assert select(looking_at(20), keys, sparsity).tolist() == [[0, 20, 38, 39]] * 2  # 10 dropped
    assert select(looking_at(10), keys, sparsity).tolist() == [[0, 10, 38, 39]] * 2  # and back
    assert select(looking_at(1)[:, :, :], keys[:, :4], sparsity).tolist() == [[0, 1, 2, 3]] * 2  # short: all


# -- the controller -------------------------------------------------------------------------------
def test_the_entropy_controller_drafts_while_it_pays():
    from outrider.control.entropy import EntropyController
    from outrider.spec.types import DraftTree, VerifyResult

    c = EntropyController(8)
    assert c.more([3.0] * 3)  # nothing timed yet: MAX deep
    for _ in range(200):  # low entropy always accepted, high entropy never
        budget = c.budgets([0], 1, lambda d: d)[0]
        budget.stop([0.05, 0.05, 4.0])
        c.observe(0, DraftTree.chain(1, [2, 3, 4]), VerifyResult([1, 2], [2, 3, 9]))
    c.observe_draft_time(0.03, 3)
    c.observe_verify_time(1, 4, 0.02)
    assert c.accept(0.05) > 0.95 and c.accept(4.0) < 0.05
    assert c.more([0.05, 0.05]) and not c.more([0.05, 4.0]) and not c.more([0.05] * 8)
    c.verify_s = 0.001  # drafting dear against the verify: fewer drafts pay
    assert not c.more([0.05] * 2)


# -- one-line refusals, before anything loads ----------------------------------------------------
@pytest.mark.parametrize("text, message", [
    ("sparsespec:x", "give up to three whole numbers, as in sparsespec[:BUDGET[,SINK[,RECENT]]] (sparsespec:256,4,32)"),
    ("sparsespec:1,2,3,4", "give up to three whole numbers, as in sparsespec[:BUDGET[,SINK[,RECENT]]] "
                           "(sparsespec:256,4,32)"),
    ("sparsespec:-5", "give up to three whole numbers, as in sparsespec[:BUDGET[,SINK[,RECENT]]] (sparsespec:256,4,32)"),
    ("sparsespec:0,0,0", "BUDGET is the keys kept a layer and head; give BUDGET >= 1 (sparsespec:256,4,32)"),
    ("sparsespec:16,8,8", "SINK 8 plus RECENT 8 leave no room for chosen keys in a BUDGET of 16; give BUDGET > "
                          "SINK + RECENT (sparsespec:256,4,32)"),
    ("sparsespec:20", "SINK 4 plus RECENT 32 leave no room for chosen keys in a BUDGET of 20; give BUDGET > "
                      "SINK + RECENT (sparsespec:256,4,32)"),
    ("sparsespec:64,window=8", "window=/sink= restrict a drafter's own attention, and sparsespec has none of its "
                               "own to restrict; they apply to draft-model, eagle3"),
])
def test_bad_options_are_refused_in_one_line(text, message):
    with pytest.raises(ConfigError) as error:
        SpecOptions(text).check()
    assert str(error.value) == f"--drafter {text!r}: {message}"


@pytest.mark.parametrize("text", ["entropy:0", "entropy:x", "entropy:65"])
def test_bad_controller_options_are_refused_in_one_line(text):
    with pytest.raises(ConfigError) as error:
        SpecOptions("sparsespec", "chain", text).check()
    assert str(error.value) == (f"--controller {text!r}: entropy[:MAX] takes the most drafts a round, a whole "
                                "number 1-64 (entropy:8)")


@pytest.mark.parametrize("drafter, tree", [("sparsespec", "static:2,2"), ("eagle3:smollm2-135m-instruct", "dynamic:4,12"),
                                           ("dflash:smollm2-135m-instruct", "ddtree:8")])
def test_the_entropy_controller_is_refused_with_a_tree(drafter, tree):
    """Issue 43: entropy stops chains only; with a tree it would act as fixed:MAX, silently, so it is
    refused at parse time in one line, and the same drafter's chain is taken."""
    with pytest.raises(ConfigError) as error:
        SpecOptions(drafter, tree, "entropy:6").check()
    assert str(error.value) == (f"--controller entropy:6 stops chains early and would draft every --tree {tree} round "
                                "to its full depth: use --tree chain, or --controller fixed:6 for this tree")
    SpecOptions(drafter, "chain", "entropy:6").check()


def test_a_budget_past_the_context_does_not_fit(tiny_folders):
    from outrider.models.config import ModelConfig

    config = ModelConfig.load(tiny_folders["llama"])
    context = config.max_position_embeddings
    assert SpecOptions(f"sparsespec:{context}").misfit(config, tiny_folders["llama"]) == (
        f"a BUDGET of {context} keys is the target's whole context of {context} tokens, so nothing would ever be "
        "dropped; give a smaller BUDGET")


def test_the_cli_refuses_before_the_model_loads(capsys):
    from outrider.cli import main

    assert main(["generate", "--model", "no-such-model", "--drafter", "sparsespec:8,4,4", "hi"]) == 2
    assert main(["generate", "--model", "no-such-model", "--drafter", "sparsespec", "--controller", "entropy:0",
                 "hi"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert lines[0].startswith("error: --drafter 'sparsespec:8,4,4': SINK 4 plus RECENT 4")
    assert lines[1].startswith("error: --controller 'entropy:0': entropy[:MAX] takes")


def test_arguments_read_back():
    assert parse_drafter("sparsespec")[1] == Sparsity(256, 4, 32)
    assert parse_drafter("sparsespec:100")[1] == Sparsity(100, 4, 32)
    assert parse_drafter("sparsespec:100,0")[1] == Sparsity(100, 0, 32)
    assert parse_drafter(f"sparsespec:{Sparsity(50, 2, 8)}")[1] == Sparsity(50, 2, 8)


# -- SmolLM2-135M --------------------------------------------------------------------------------
CODE = "def is_prime(n):\n    \"\"\"Return True if n is a prime number.\"\"\"\n    if n < 2:\n        return False\n"


@pytest.mark.model
@pytest.mark.parametrize("controller", ["entropy:6"])  # fixed depths: the tiny models' tests
def test_smollm2_sparsespec_greedy_output_is_autoregressive(smollm2_decoder, smollm2_path, smollm2_tokenizer,
                                                            controller):
    target = smollm2_decoder
    spec = Speculator.build(SpecOptions("sparsespec:24,4,8", "chain", controller), target, smollm2_path)
    prompt = smollm2_tokenizer(CODE + CODE.replace("is_prime", "is_odd"))["input_ids"]
    assert len(prompt) > 2 * 24
    ar = generate_ids(target, [Request(list(prompt), 24)], set())[0]
    sp = generate_ids(target, [Request(list(prompt), 24)], set(), speculation=spec)[0]
    assert sp.token_ids == ar.token_ids
    assert sum(sp.round_stats.accepted_by_position) > 0
    assert max(spec.drafter.kept_share) < 0.5


def test_the_seeds_preset_runs_sparsespec_fixed_and_with_the_entropy_controller():
    from outrider.bench.methods import load_config, preset_path

    specs = {(m.spec.drafter, m.spec.controller) for m in load_config(preset_path("seeds")).methods if m.spec}
    assert {("sparsespec:256,4,32", "fixed:4"), ("sparsespec:256,4,32", "entropy:8")} <= specs
