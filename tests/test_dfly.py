"""DFly (heads/dflash/dfly.py, drafters/dfly.py) on a tiny random target with a tiny DFlash head:
with its gate and correction at zero it is its DFlash head, logit for logit; the fast path (the
context written per layer into the cache, the block, the readout chained slot by slot) equals the
slow differentiable one; greedy speculation equals plain decoding with drafts accepted; a sampled
chain reproduces per seed and its q's are the chained ones; the weights file round-trips."""

import pytest
import torch
from dflash_fixtures import random_head
from enumerate_law import one_thread

from outrider.control.controllers import FixedController
from outrider.drafters.dfly import DFlyDrafter
from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.errors import ConfigError
from outrider.heads.dflash.dfly import DFlyHead, DFlyWeights, block_logits
from outrider.models.batch import causal_batch
from outrider.sampling import SamplingParams
from outrider.spec.shapes import parse_shape
from outrider.weights.loader import load_decoder

PROMPTS = [[3, 4, 5, 3, 4, 5, 3], [6, 7, 3, 6, 7, 3, 6], [5], [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4]]


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from tiny import make_tiny

    return load_decoder(make_tiny("llama", tmp_path_factory.mktemp("dfly") / "t", vocab=8, layers=4), "cpu")


def extra(seed=5, gate=1.0, up=0.5, layers=2, hidden=64, down=0.3):
    g = torch.Generator().manual_seed(seed)
    return DFlyWeights((0, 2, 3), torch.randn(layers, 3, generator=g), torch.full((layers,), gate) + 0.3 * torch.arange(layers),
                       torch.randn(hidden, hidden, generator=g) * 0.3, torch.randn(8, hidden, generator=g) * down,
                       torch.randn(hidden, 8, generator=g) * up)


def dfly(target, **kw):
    base = random_head(hidden=64, vocab=8, layers=2, heads=4, kv_heads=2, block=5, taps=3, seed=3,
                       embed=target.embed, lm_head=target.lm_head, mask_token_id=0)
    return DFlyHead(base, extra(**kw), target.config.num_layers)


def features(target, head, text):
    cache = target.new_cache(1, len(text))
    out = target.forward(causal_batch([torch.tensor(text)], hidden_layers=tuple(sorted(head.taps)),
                                      scratch_row=cache.scratch_row), cache)
    return torch.stack([out.hidden[t][0] for t in head.taps], dim=1)  # [n, taps, H]


TEXT = [1, 5, 3, 6, 2, 7, 4, 3, 5, 6, 1, 2]


def fast(head, feats, anchors):
    """The drafter's path: contexts into the cache, the block, the readout chained on the text's tokens."""
    cache = head.new_cache(1, len(TEXT) + 8)
    head.write_context(cache, 0, 0, head.contexts(feats))
    B = head.block_size
    out = []
    for a in anchors:
        block = torch.full((1, B), head.config.mask_token_id, dtype=torch.long)
        block[0, 0] = TEXT[a]
        logits, hidden = head.block(cache, [0], [a], block)
        out.append((logits[0], torch.stack([head.correct(hidden[0, k], torch.tensor(TEXT[a + k - 1]))
                                            for k in range(1, B)])))
    return out


def test_zero_gate_and_correction_is_the_dflash_head(target):
    head = dfly(target, gate=0.0, up=0.0)
    head.extra.gate.zero_()
    feats = features(target, head, TEXT)
    for plain, chained in fast(head, feats, [2, 4, 6]):
        assert torch.allclose(plain, chained, atol=1e-5)  # the DFlash head's own logits (row by row: rounding)
    base_cache = head.new_cache(1, 20)
    head.base.write_context(base_cache, 0, 0, head.base.fuse(feats[:, head._own]))
    block = torch.tensor([[TEXT[4], 0, 0, 0, 0]])
    want, _ = head.base.block(base_cache, [0], [4], block)
    assert torch.allclose(fast(head, feats, [4])[0][1], want[0], atol=1e-5)


def test_fast_path_equals_the_slow_one_and_the_mix_and_correction_matter(target):
    head = dfly(target)
    feats = features(target, head, TEXT)
    anchors = [1, 3, 6]
    slow = block_logits(head, feats, torch.tensor(TEXT), anchors)  # [A, B-1, V]
    got = torch.stack([c for _, c in fast(head, feats, anchors)])
    assert torch.allclose(got, slow, atol=1e-4), float((got - slow).abs().max())
    plain = torch.stack([p for p, _ in fast(head, feats, anchors)])
    assert (got - plain).abs().max() > 1e-2  # the correction changes the readout
    other = dfly(target)
    other.extra.mix_logits[0, 0] += 3.0  # another mix for layer 0
    assert (block_logits(other, feats, torch.tensor(TEXT), anchors) - slow).abs().max() > 1e-3


def speculator(target, depth=3):
    shape = parse_shape("chain")
    return Speculator(SpecOptions("dfly:x", "chain", f"fixed:{depth}"), DFlyDrafter(dfly(target), shape),
                      FixedController(depth), shape)


def run(target, spec, params=SamplingParams()):
    return generate_ids(target, [Request(list(p), 16, params) for p in PROMPTS], set(), speculation=spec)


def test_greedy_equals_plain_and_sampled_reproduces(target):
    spec = speculator(target)
    got = run(target, spec)
    assert [f.token_ids for f in got] == [f.token_ids for f in run(target, None)]
    assert sum(f.round_stats.committed for f in got) > sum(f.round_stats.rounds for f in got)
    params = SamplingParams(temperature=1.0, seed=3)
    a = [f.token_ids for f in run(target, speculator(target), params)]
    assert a == [f.token_ids for f in run(target, speculator(target), params)]
    with pytest.raises(ConfigError, match="chain"):
        DFlyDrafter(dfly(target), parse_shape("ddtree:6"))


def test_weights_round_trip(target, tmp_path):
    e = extra()
    e.save(tmp_path)
    back = DFlyWeights.load(tmp_path / "dfly.safetensors", "cpu", torch.float32)
    assert back.mix_ids == e.mix_ids and all(torch.equal(a, b) for a, b in zip(back.tensors().values(),
                                                                                 e.tensors().values()))


def test_domain_rule():
    from outrider.drafters.angelspec import domain

    assert domain("def add(a, b):\n    return a + b") == "code"
    assert domain('{"name": "get_weather", "arguments": {"city": "Paris"}}') == "code"
    assert domain("12 * (3 + 4) = ?") == "math"
    assert domain("Write a short poem about the sea.") == "chat"


def test_angelspec_routes_each_request_and_stays_exact(target, tmp_path):
    from outrider.drafters.angelspec import AngelSpecDrafter
    from outrider.drafters.eagle3 import Eagle3Drafter
    from outrider.heads.mtp.format import load_mtp
    from outrider.heads.mtp.trainable import MtpTrainable
    from outrider.heads.staging import staged_head

    model = MtpTrainable.for_target(target, seed=2)
    with torch.no_grad():
        for name in ("eh_proj", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            getattr(model, name).mul_(30)
    with staged_head(tmp_path / "mtp", model.export_config(), model.state_tensors()):
        pass
    shape = parse_shape("chain")
    head = load_mtp(tmp_path / "mtp", target)
    mtp = Eagle3Drafter(head, shape, head.config.taps(target.config.num_layers), name="mtp")
    # prompts starting with an odd token read as code (DFly), the others as chat (MTP)
    router = AngelSpecDrafter(mtp, DFlyDrafter(dfly(target), shape),
                              lambda ids: "def f(): return 1;" if ids[0] % 2 else "hello there")
    assert router.capabilities.needs_hidden == (1, 2, 3, 4)  # DFly's 1, 2, 3 (fc) and 1, 3, 4 (mix), MTP's 4: once each
    spec = Speculator(SpecOptions("angelspec:x", "chain", "fixed:3"), router, FixedController(3), shape)
    got = run(target, spec)
    assert [f.token_ids for f in got] == [f.token_ids for f in run(target, None)]
    assert router.routed == {"mtp": 1, "dfly": 3}
    assert sum(f.round_stats.committed for f in got) > sum(f.round_stats.rounds for f in got)


def test_the_drafted_chain_is_read_out_slot_after_slot(target):
    from outrider.spec.types import Budget

    head = dfly(target, seed=6, down=50.0)  # a correction strong enough to change argmaxes (the embeddings are ~0.02)
    drafter = DFlyDrafter(head, parse_shape("chain"))
    prompt = TEXT[:8]
    drafter.start(0, prompt, SamplingParams(), hidden=features(target, head, prompt)[:-1])
    tree = drafter.propose(0, prompt, Budget(4, 4))
    drafts = tree.tokens.tolist()  # [root, t1..t4]
    block = torch.full((1, head.block_size), head.config.mask_token_id, dtype=torch.long)
    block[0, 0] = prompt[-1]
    _, hidden = head.block(drafter.cache, [drafter._states[0].slot], [len(prompt) - 1], block)
    for k in range(1, len(drafts)):  # slot k's argmax given the token drafted at slot k-1
        assert drafts[k] == int(head.correct(hidden[0, k], torch.tensor(drafts[k - 1])).argmax())
    assert len(set(drafts)) > 2  # not one token over and over: the predecessors differ
