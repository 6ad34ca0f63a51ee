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


def head_for(target, variant="vanilla", seed=3, block=5, anchor_predicts=True):
    return random_dspark_head(variant, rank=4, block=block, seed=seed, hidden=64, vocab=8, layers=2, heads=4,
                              kv_heads=2, taps=3, embed=target.embed, lm_head=target.lm_head, mask_token_id=0,
                              anchor_predicts=anchor_predicts)


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


def speculator(target, variant="vanilla", depth=4, sps=None, anchor_predicts=True):
    h = head_for(target, variant, anchor_predicts=anchor_predicts)
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


def test_over_dflash_s_own_readout_the_positions_are_slots_1_to_b_minus_1(target, plain):
    h = random_dspark_head(seed=6, anchor_predicts=False)
    feats, toks = torch.randn(5, 2, 32), torch.tensor([[9, 1, 1, 1, 1, 1]])
    cache = h.new_cache(1, 16)
    h.write_context(cache, 0, 0, h.fuse(feats))
    U, hbar = h.block(cache, [0], [5], toks)
    assert h.gamma == 5 and U.shape[1] == 5 and hbar.shape[1] == 5
    torch.testing.assert_close(U[0], h.backbone.block(cache, [0], [5], toks)[0][0])  # DFlash's own logits
    spec = speculator(target, "rnn", anchor_predicts=False)
    assert spec.drafter.max_nodes(9) == 4  # block 5: 4 positions
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
        DSparkDrafter(random_dspark_head(), parse_shape("static:2,2"), (1, 2))  # chain, pctree:N, ddtree:N only


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


# -- on disk: training module = runtime head, export, check-head -----------------------------------
FAST_PROMPTS = ("w5 w6 w7", "w3 w4")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from tiny import add_tokenizer, make_tiny

    from outrider.heads.dspark.export import export_dspark
    from outrider.heads.dspark.trainable import DSparkTrainable
    from outrider.heads.golden import GoldenSettings
    from outrider.train.outputs import write_head

    root = tmp_path_factory.mktemp("dsexport")
    folder = add_tokenizer(make_tiny("llama", root / "t", vocab=8, layers=4), vocab=8)
    decoder = load_decoder(folder, "cpu")
    module = DSparkTrainable.for_target(decoder, torch.arange(8), seed=1, layers=2, block_size=4, mask_token_id=7,
                                        layer_ids=(0, 2), variant="rnn", rank=4)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    write_head(root / "trained", module)
    out = export_dspark(root / "trained", root / "out", folder, settings=GoldenSettings(max_new_tokens=10),
                        prompts=FAST_PROMPTS)
    return root, folder, decoder, module, out


def test_the_training_forward_equals_the_runtime_head(exported):
    from outrider.heads.dspark.format import load_dspark

    _, _, decoder, module, out = exported
    head = load_dspark(out, decoder)
    g = torch.Generator().manual_seed(2)
    feats, toks = torch.randn(1, 9, 2, 64, generator=g), torch.tensor([[3, 5, 1, 2, 6, 0, 4, 4, 1]])
    anchors = torch.tensor([[4]])
    prev = toks[:, 4:8].unsqueeze(1)  # [1, 1, G]: x_a .. x_{a+G-1}
    with torch.no_grad():
        logits, conf = module.block_logits_all(feats, toks, anchors, prev)
    cache = head.new_cache(1, 16)
    head.write_context(cache, 0, 0, head.fuse(feats[0, :4]))
    block = torch.tensor([[toks[0, 4].item(), 7, 7, 7]])
    U, hbar = head.block(cache, [0], [4], block)
    want, want_conf = reference_chain(head, U[0], hbar[0], prev[0, 0].tolist())
    torch.testing.assert_close(logits[0, 0], want, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(torch.sigmoid(conf[0, 0]), want_conf, atol=1e-5, rtol=1e-4)


def test_check_head_passes_the_export_and_fails_a_zeroed_markov_head(exported, tmp_path):
    from safetensors.torch import load_file, save_file

    from outrider.heads.dspark.check import check
    from outrider.heads.kinds import kind_of

    root, folder, _, _, out = exported
    raw = json.loads((out / "config.json").read_text())
    assert kind_of(raw).name == "dspark" and raw["speculators_model_type"] == "dspark"
    assert raw["markov_head_type"] == "rnn" and raw["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    checks = check(out, folder)
    assert [c.status for c in checks if c.status == "FAIL"] == [], [c.line() for c in checks]
    assert {c.name for c in checks if c.status == "ok"} >= {"tensors", "golden logits", "golden tau"}
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    tensors["markov_head.out_proj.weight"].zero_()
    save_file(tensors, str(bad / "model.safetensors"))
    failed = [c for c in check(bad, folder) if c.status == "FAIL"]
    assert [c.name for c in failed][:1] == ["golden logits"] and "\n" not in failed[0].line()
    mixed = tmp_path / "mixed"
    shutil.copytree(out, mixed)
    tensors = load_file(str(mixed / "model.safetensors"))
    tensors["confidence_head.proj.bias"] = tensors["confidence_head.proj.bias"].half()
    save_file(tensors, str(mixed / "model.safetensors"))
    assert "mixed float dtypes" in next(c.detail for c in check(mixed, folder, golden=False) if c.name == "tensors")
    gamma = tmp_path / "gamma"
    shutil.copytree(out, gamma)
    raw["block_size"] = 8
    del raw["dspark_config"]  # (its 4 temperatures would fail the config fields first)
    (gamma / "config.json").write_text(json.dumps(raw))
    assert any(c.name == "block size" and c.status == "FAIL" for c in check(gamma, folder, golden=False))


# -- sampling through the Markov chain: the empirical law against the exact one ----------------------
def test_sampled_markov_chain_passes_chi_square_and_a_wrong_q_fails():
    from collections import Counter

    from enumerate_law import ToyModel, autoregressive_law, generate
    from test_verify_chisquare import chi_square_p_value

    from outrider.spec.random import PositionalRandom
    from outrider.spec.verify_chain import verify_chain

    target, drafter = ToyModel(3, seed=1), ToyModel(3, seed=2)
    params, RUNS = SamplingParams(temperature=1.0), 300
    head = random_dspark_head("gated", rank=3, block=3, seed=5, scale=3.0, hidden=8, vocab=3, layers=1, heads=2,
                              kv_heads=1, mask_token_id=0)
    hidden = torch.randn(3, 8, generator=torch.Generator().manual_seed(3))

    def block_of(committed):
        rows = torch.stack([drafter.logits(list(committed)).float()] * 3)  # U_k: fixed by the context
        return Block(committed[-1], len(committed) - 1, rows, hidden, vocab=3)

    def honest(committed, rng):
        return markov_chain(head, block_of(committed), 2, params, rng.drafting())

    def wrong_q(committed, rng):  # drawn through the Markov head, reported as the backbone's q
        tree = honest(committed, rng)
        q = torch.softmax(block_of(committed).logits[:2].double(), -1).float()
        return type(tree)(tree.tokens, tree.parents, torch.cat((q, torch.zeros(1, 3)))[: tree.size])

    def p_value(propose):
        with one_thread():
            counts = Counter(generate([0, 1], 2, PositionalRandom(1234 + r), target, propose, verify_chain, params)
                             for r in range(RUNS))
        return chi_square_p_value(counts, autoregressive_law([0, 1], 2, target, params), RUNS)

    assert p_value(honest) > 1e-4
    assert p_value(wrong_q) < 1e-4


def test_a_training_step_aligns_labels_previous_tokens_and_the_target_rows(exported):
    """A module that reads out exactly the next token, against a target whose row at p is that
    token too: every scored slot is a hit with nearly no loss, and the Markov head was fed x_{a+j}."""
    from types import SimpleNamespace

    _, _, _, module, _ = exported
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 8, (2, 12), generator=g)
    nxt = torch.cat((tokens[:, 1:], tokens[:, :1]), 1)  # [S, T] x_{p+1} (the last wraps: never scored)
    tb = SimpleNamespace(tokens=tokens, valid=torch.ones(2, 12, dtype=torch.bool), features=torch.zeros(2, 12, 2, 64),
                         draft_logits=torch.nn.functional.one_hot(nxt, 8).float() * 60)

    def perfect(features, toks, anchors, prev):
        G = prev.shape[-1]
        at = anchors.unsqueeze(-1) + torch.arange(G)  # [S, A, G]
        assert torch.equal(prev, toks.gather(1, at.clamp(max=11).view(2, -1)).view_as(at))  # x_{a+j}
        label = toks.gather(1, (at + 1).clamp(max=11).view(2, -1)).view_as(at)
        return torch.nn.functional.one_hot(label, 8).float() * 60, torch.full(label.shape, 30.0)

    module.block_logits_all, saved = perfect, module.block_logits_all
    try:
        out = module.step(tb, torch.Generator().manual_seed(0), 3)
    finally:
        del module.block_logits_all
    assert sum(out.rows) > 0 and out.hits == [float(r) for r in out.rows]
    assert all(float(s) < 1e-6 * max(r, 1) for s, r in zip(out.sums, out.rows))


def test_the_golden_computes_are_the_chain_teacher_forced_on_the_text():
    from outrider.heads.dspark.golden import forced_logits

    h = random_dspark_head("rnn", seed=8)
    text = [3, 9, 4, 17, 2, 60, 33, 5, 8, 1, 12, 40]
    cache = h.new_cache(1, 24)
    h.write_context(cache, 0, 0, h.fuse(torch.randn(len(text), 2, 32)))
    got = forced_logits(h, cache, text, [4, 7])
    for i, a in enumerate((4, 7)):
        U, hbar = h.block(cache, [0], [a], torch.tensor([[text[a]] + [1] * 5]))
        padded = text + [text[-1]] * 6
        want, _ = reference_chain(h, U[0], hbar[0], padded[a:a + 6])
        torch.testing.assert_close(got[i], want, atol=1e-5, rtol=1e-5)


def test_the_shipped_head_resolves_and_conforms():
    from outrider.drafters.registry import parse_drafter
    from outrider.heads.catalog import resolve_head
    from outrider.heads.dspark.check import check

    folder = resolve_head("smollm2-135m-instruct", "dspark")
    assert folder.parent.name == "dspark" and (folder / "outrider_golden.json").is_file()
    assert (folder / "model.safetensors").stat().st_size <= 25 * 2**20
    checks = check(folder, "smollm2-135m-instruct", golden=False)
    assert [c.line() for c in checks if c.status == "FAIL"] == []
    assert {"tensors", "config fields", "target", "calibration", "block size"} <= {c.name for c in checks if c.status == "ok"}
    assert str(folder) in str(parse_drafter("dspark:smollm2-135m-instruct")[1])


# -- `outrider train dspark` on the one loop -----------------------------------------------------------
def test_train_dspark_on_the_one_loop_lowers_the_loss_and_a_frozen_backbone_stays(tmp_path):
    import random

    from safetensors.torch import load_file
    from train_common import SEQ, log_of, options, words, write_jsonl
    from tiny import add_tokenizer, make_tiny

    from outrider.heads.dflash.trainable import DFlashTrainable
    from outrider.heads.dspark.format import load_dspark
    from outrider.train.loop import train
    from outrider.train.outputs import write_head

    target = add_tokenizer(make_tiny("llama", tmp_path / "t", vocab=96, layers=4))
    one = write_jsonl(tmp_path / "one.jsonl", [{"text": words(random.Random(5), SEQ)}])
    common = dict(steps=6, lr=3e-3, warmup_steps=0, head="dspark", block_size=4, anchors=8, draft_vocab=None,
                  markov_rank=4)
    train(options(target, one, tmp_path / "paper", **common), log=lambda m: None)
    log = log_of(tmp_path / "paper")
    assert log[-1]["loss"] < log[0]["loss"] and len(log[-1]["step_acc"]) == 4  # every slot a position
    assert load_dspark(tmp_path / "paper", load_decoder(target, "cpu")).gamma == 4
    decoder = load_decoder(target, "cpu")
    backbone = DFlashTrainable.for_target(decoder, torch.arange(96), seed=2, layers=1, block_size=4, mask_token_id=95,
                                          layer_ids=(1,))
    write_head(tmp_path / "dflash", backbone)
    train(options(target, one, tmp_path / "frozen", backbone=str(tmp_path / "dflash"), backbone_mode="frozen",
                  **common), log=lambda m: None)
    before, after = load_file(str(tmp_path / "dflash" / "model.safetensors")), \
        load_file(str(tmp_path / "frozen" / "model.safetensors"))
    for name, tensor in before.items():
        torch.testing.assert_close(after[name], tensor, rtol=1e-5, atol=1e-6)  # the backbone as it was
    assert float(after["markov_head.out_proj.weight"].abs().max()) > 0  # the Markov head trained
    head = load_dspark(tmp_path / "frozen", decoder)
    assert head.gamma == 3 and not head.spec.anchor_predicts and len(log_of(tmp_path / "frozen")[-1]["step_acc"]) == 3
