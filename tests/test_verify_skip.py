"""Verifier skipping, `--verifier verify-skip-lossy:T[,G]` (spec/verify_skip.py; issue 44 item 1): LOSSY,
so only by its `-lossy` name, never a default nor among the lossless verifiers, greedy chains only.
The verifier equals its node-by-node reference; with T > 1 (never skip) a draft model's output is
plain greedy decoding's, in as many verifier calls as strict verification of G-blocks; with a low T
it skips, in fewer calls."""

import random

import pytest
import torch
from enumerate_law import one_thread
from tiny import make_tiny

from outrider.control.controllers import FixedController
from outrider.drafters.model import ModelDrafter
from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.errors import ConfigError
from outrider.sampling import SamplingParams
from outrider.spec.shapes import parse_shape
from outrider.spec.types import DraftTree
from outrider.spec.verifiers import VERIFIERS, choose_verifier, lossless_names, verifier_entry
from outrider.spec.verify_skip import SkipVerifier, raw_confidence, verify_skip_reference
from outrider.weights.loader import load_decoder

PROMPTS = [[3, 4, 5, 3, 4, 5, 3], [6, 7, 3, 6, 7, 3, 6], [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4]]


def test_the_verifier_equals_its_reference():
    rng = random.Random(0)
    for trial in range(300):
        k, vocab = rng.randint(0, 8), 5
        tokens = [rng.randrange(vocab) for _ in range(k + 1)]
        share = [rng.choice([0.2, 0.5, 0.8, 0.95, 1.0]) for _ in range(k)]
        conf = [1.0]
        for s in share:
            conf.append(conf[-1] * s)
        logits = torch.randn(k + 1, vocab, generator=torch.Generator().manual_seed(trial))
        for i in range(k):  # make the target agree often
            if rng.random() < 0.6:
                logits[i, tokens[i + 1]] += 10
        tree = DraftTree(torch.tensor(tokens), torch.arange(-1, k), confidence=torch.tensor(conf, dtype=torch.float64))
        assert raw_confidence(tree) == pytest.approx(share)
        for threshold in (0.5, 0.9, 1.0, 1.01):
            for block in (1, 2, 4):
                got = SkipVerifier(threshold, block)(tree, logits)
                want = verify_skip_reference(tree, logits, threshold, block)
                assert (got.accepted_nodes, got.tokens) == (want.accepted_nodes, want.tokens)


def test_it_skips_the_confident_prefix_unverified_and_verifies_a_block_after_it():
    tree = DraftTree(torch.tensor([9, 1, 2, 3, 4, 0]), torch.arange(-1, 5),
                     confidence=torch.tensor([1.0, 0.95, 0.95 * 0.92, 0.95 * 0.92 * 0.3, 0.01, 0.005]))
    logits = torch.zeros(6, 5)
    logits[:, 4] = 1.0  # the target wants 4 everywhere: it would reject the first draft
    v = SkipVerifier(0.9, 2)
    result = v(tree, logits)
    # raw confidences 0.95, 0.92, 0.3, ...: 1 and 2 committed unverified, the block 3, 4 verified: 3 != 4
    assert result.accepted_nodes == [1, 2] and result.tokens == [1, 2, 4]
    assert (v.rounds[0].skipped, v.rounds[0].checked, v.rounds[0].accepted) == (2, 2, 0)
    logits[2, 3] = 2.0  # now the target takes 3, then wants 4 after it: the block's both drafts accepted
    assert v(tree, logits).tokens == [1, 2, 3, 4, 4]
    assert SkipVerifier(0.9, 4)(tree, logits).tokens == [1, 4]  # room for a block of 4: only 1 skipped, 2 rejected
    assert SkipVerifier(1.5, 2)(tree, torch.zeros(6, 5)).tokens == [0]  # never skip: greedy on 2 drafts


def test_only_its_lossy_name_turns_it_on():
    assert "verify-skip-lossy" not in VERIFIERS and not any("skip" in n for n in lossless_names())
    entry = verifier_entry("verify-skip-lossy:0.8,3")
    assert entry.lossy and (entry.verify.threshold, entry.verify.block) == (0.8, 3)
    assert verifier_entry("verify-skip-lossy:0.8,3") is entry and verifier_entry("verify-skip:0.8") is None
    for bad in ("verify-skip-lossy:x", "verify-skip-lossy:0.9,0", "verify-skip-lossy:-1", "verify-skip-lossy:1,2,3"):
        with pytest.raises(ConfigError):
            verifier_entry(bad)
    with pytest.raises(ConfigError, match="no such verifier"):
        SpecOptions("ngram", "chain", "fixed:4", verifier="verify-skip:0.9").check()
    SpecOptions("ngram", "chain", "fixed:4", verifier="verify-skip-lossy:0.9").check()
    with pytest.raises(ConfigError, match="verifies only a chain"):
        SpecOptions("draft-model:x", "static:2,2", "fixed:4", verifier="verify-skip-lossy:0.9").check()
    choice = choose_verifier("chain", False, SamplingParams(), name="verify-skip-lossy:0.9")
    assert choice.ok and "LOSSY" in choice.reason
    assert not choose_verifier("chain", True, SamplingParams(temperature=1.0), name="verify-skip-lossy:0.9").ok
    assert choose_verifier("chain", False, SamplingParams()).name == "greedy_chain"  # never the default


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    with one_thread():
        root = tmp_path_factory.mktemp("skip")
        target = load_decoder(make_tiny("llama", root / "t", vocab=8, layers=3), "cpu")
        draft = load_decoder(make_tiny("llama", root / "d", vocab=8, seed=3, layers=1), "cpu")
        yield target, draft


def _run(target, draft, depth, verifier=None):
    shape = parse_shape("chain")
    drafter = ModelDrafter(draft, shape, name="draft-model:tiny")
    spec = Speculator(SpecOptions("draft-model:tiny", "chain", f"fixed:{depth}", verifier=verifier), drafter,
                      FixedController(depth), shape) if depth else None
    with one_thread():
        done = generate_ids(target, [Request(list(p), 20) for p in PROMPTS], set(), speculation=spec)
    return [d.token_ids for d in done], sum(d.round_stats.rounds for d in done)


def test_never_skipping_is_plain_greedy_in_strict_calls_and_skipping_saves_calls(models):
    target, draft = models
    plain, _ = _run(target, draft, 0)
    strict, strict_calls = _run(target, draft, 2)
    never, never_calls = _run(target, draft, 6, "verify-skip-lossy:1.01,2")
    assert strict == plain and never == plain and never_calls == strict_calls
    always, always_calls = _run(target, draft, 6, "verify-skip-lossy:0.0,2")  # every draft but a block skipped
    assert always_calls < strict_calls and always != plain
