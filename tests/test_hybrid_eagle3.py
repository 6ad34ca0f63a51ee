"""An EAGLE-3 head on a gated-delta hybrid (issue 39, item 5): `outrider train eagle3` on a small
random Qwen3.5 saved by transformers (the training pass's taps through the hybrid's state equal
the runtime's own forward), then EAGLE-3 drafting on it, chains and trees, and SpecLA (a pruned,
cost-sized tree: control/specla.py) with greedy speculative output equal to plain decoding."""

from __future__ import annotations

import pytest
import torch
from tiny import add_tokenizer, make_tiny
from train_common import write_jsonl

from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.models.batch import pack
from outrider.sampling import SamplingParams
from outrider.train.data import Example
from outrider.train.target_pass import target_pass
from outrider.weights.loader import load_decoder

PROMPTS = [[5, 17, 33, 8, 5, 17, 33, 9, 40, 41], [7, 7, 12, 30, 31, 7, 12]]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return add_tokenizer(make_tiny("qwen3_5", tmp_path_factory.mktemp("hybrid_e3") / "qwen3_5", layers=4))


@pytest.fixture(scope="module")
def model(folder):
    return load_decoder(folder, "cpu", torch.float32)


@pytest.fixture(scope="module")
def head(folder, model, tmp_path_factory):
    """A head trained by the CLI, as a user runs it, on the target's own greedy text from the
    test's prompts (a few seconds: it learns those continuations, so drafts are accepted and
    commits run deep into chains and trees)."""
    from outrider.cli import main

    root = tmp_path_factory.mktemp("hybrid_e3_head")
    outs = generate_ids(model, [Request(p, 28, SamplingParams(0.0)) for p in PROMPTS], set())
    texts = [" ".join(f"w{i}" for i in p + o.token_ids) for p, o in zip(PROMPTS, outs)]
    corpus = write_jsonl(root / "train.jsonl", [{"text": t} for t in texts])
    out = root / "head"
    code = main(["train", "eagle3", "--target", str(folder), "--data", f"jsonl:{corpus}", "--out", str(out),
                 "--steps", "80", "--lr", "1e-2", "--warmup-steps", "0", "--seq-len", "40", "--batch-size", "2",
                 "--ttt-steps", "3", "--draft-vocab", "96", "--threads", "1", "--no-progress"])
    assert code == 0
    return out


def test_the_training_pass_taps_the_hybrid_as_its_forward_does(model):
    """Training's target pass (a padded causal batch: the gated-delta layers fold it chunk by
    chunk) gives, at every real position, the taps and logits of the runtime's forward of that
    sequence alone with its tokens held as a verify's (TreeWY over held rows)."""
    taps = (1, 2, 3)
    seqs = [[3, 9, 4, 11, 7, 8, 20, 5, 3, 9, 60, 61], [12, 30, 31, 2, 9]]
    examples = [Example(s, [True] * len(s)) for s in seqs]
    used = torch.arange(model.config.vocab_size)
    got = target_pass(model, examples, taps, used)
    for b, s in enumerate(seqs):
        cache = model.new_cache(1, 16)
        out = model.forward(pack([0], [0], [torch.tensor(s)], [torch.arange(-1, len(s) - 1)], hidden_layers=taps,
                                 scratch_row=cache.scratch_row), cache)
        want = torch.stack([out.hidden[t][0] for t in taps], dim=1)  # [T, 3, E]
        n = len(s)
        assert torch.allclose(got.features[b, :n], want, atol=1e-5), (got.features[b, :n] - want).abs().max()
        assert torch.allclose(got.draft_logits[b, :n], out.logits[0], atol=1e-4)
        assert got.valid[b, : n - 1].all() and not got.valid[b, n - 1:].any()


SPECS = [("chain", "fixed:3"), ("static:2,2", "fixed:3"), ("dynamic:3,6", "fixed:3"),
         ("dynamic:3,8", "specla:4,0.01"), ("dynamic:3,8", "specla:4,0"), ("chain", "specla:3,0.01")]


@pytest.fixture(scope="module")
def plain(model):
    return [f.token_ids for f in generate_ids(model, [Request(p, 16, SamplingParams(0.0)) for p in PROMPTS], set())]


@pytest.mark.parametrize("tree, controller", SPECS, ids=[f"{t}-{c}" for t, c in SPECS])
def test_eagle3_drafting_on_a_hybrid_equals_plain_decoding(model, folder, head, plain, tree, controller):
    requests = [Request(p, 16, SamplingParams(0.0)) for p in PROMPTS]
    spec = Speculator.build(SpecOptions(f"eagle3:{head}", tree, controller), model, folder)
    fast = generate_ids(model, requests, set(), speculation=spec)
    assert [f.finish_reason for f in fast] == ["length", "length"], [f.error for f in fast]
    assert [f.token_ids for f in fast] == plain
    # drafts accepted, commits deep (SpecLA's cost model may verify fewer of them)
    assert min(f.stats["mean_accepted_length"] for f in fast) > (1.8 if controller.startswith("fixed") else 1.3)


@pytest.mark.parametrize("tree", ["chain", "dynamic:3,8"])
def test_seeded_sampling_with_specla_is_the_plain_sample(model, folder, head, tree):
    """At temperature > 0 with a seed, the walk commits what plain seeded sampling draws, whatever
    SpecLA pruned and sized."""
    requests = [Request(PROMPTS[0], 16, SamplingParams(0.8, seed=5))]
    want = [f.token_ids for f in generate_ids(model, requests, set())]
    spec = Speculator.build(SpecOptions(f"eagle3:{head}", tree, "specla:4,0.01"), model, folder)
    assert [f.token_ids for f in generate_ids(model, requests, set(), speculation=spec)] == want
    assert spec.controller.verified > 0
