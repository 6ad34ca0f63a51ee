"""AdaFlash (issue 44 item 2; heads/dflash/opd.py, length_head.py, drafters/adaflash.py) on tiny
random targets: the reverse KL equals a slow reference; the target's scores are taken along the
drafted prefix (against a plain forward of each prefix); `outrider train dflash --objective opd`
lowers its loss and `--objective length` writes a length head the drafter loads; the length head's
features equal a slow reference and its cut is the formula's; with the length head cutting the
blocks, greedy speculation equals plain decoding token for token while the drafted chains are
shorter than the block; bad options are one-line errors."""

import random

import pytest
import torch
from dflash_fixtures import random_head
from enumerate_law import one_thread
from train_common import SEQ, log_of, options, target, words, write_jsonl  # noqa: F401 (fixtures)

from outrider.control.controllers import FixedController
from outrider.drafters.adaflash import AdaFlashDrafter
from outrider.drafters.registry import parse_drafter
from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.errors import ConfigError
from outrider.heads.dflash.length_head import FILE, LengthHead, pooled, pooled_reference, verify_length
from outrider.heads.dflash.opd import reverse_kl, reverse_kl_reference, target_along_drafts
from outrider.models.batch import pack
from outrider.sampling import SamplingParams
from outrider.spec.shapes import parse_shape
from outrider.train.loop import train
from outrider.weights.loader import load_decoder

PROMPTS = [[3, 4, 5, 3, 4, 5, 3], [6, 7, 3, 6, 7, 3, 6], [5], [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4]]


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    from tiny import make_tiny

    return load_decoder(make_tiny("llama", tmp_path_factory.mktemp("adaflash") / "t", vocab=8, layers=4), "cpu")


def test_reverse_kl_equals_the_slow_reference():
    g = torch.Generator().manual_seed(0)
    used = torch.tensor([0, 2, 3, 5, 9, 11])  # a reduced draft vocabulary of 6 among 12
    draft = torch.randn(2, 3, 6, generator=g) * 2
    full = torch.randn(2, 3, 12, generator=g) * 2
    fast = reverse_kl(draft, torch.log_softmax(full, -1)[..., used])
    slow = reverse_kl_reference(draft, full, used)
    torch.testing.assert_close(fast.double(), slow, rtol=1e-5, atol=1e-6)
    assert bool((fast > 0).all())
    forward_kl = (torch.softmax(full[..., used], -1) * (torch.log_softmax(full[..., used], -1)
                                                       - torch.log_softmax(draft, -1))).sum(-1)
    assert not torch.allclose(fast, forward_kl, atol=1e-3)  # the direction is KL(q || p)
    same = torch.randn(4, 12, generator=g)
    assert float(reverse_kl(same, torch.log_softmax(same, -1)).abs().max()) < 1e-5  # q == p: zero


def test_the_target_scores_each_slot_along_the_drafted_prefix(small):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(1, 8, (2, 10), generator=g)
    anchors, real = torch.tensor([[7, 2, 4], [1, 5, 8]]), torch.tensor([[True, True, True], [True, False, True]])
    drafted = torch.randint(0, 8, (2, 3, 4), generator=g)
    fast = target_along_drafts(small, tokens, [10, 10], anchors, real, drafted)  # [2, 3, 4, 8]
    for s in range(2):
        for j in range(3):
            if not real[s, j]:
                assert float(fast[s, j].abs().max()) == 0
                continue
            a = int(anchors[s, j])
            for k in range(4):  # slot k+1: after x_0..x_a and drafted 1..k
                prefix = torch.cat((tokens[s, : a + 1], drafted[s, j, :k]))
                cache = small.new_cache(1, 16)
                want = small.forward(pack([0], [0], [prefix], logits="last"), cache).logits[0, -1]
                torch.testing.assert_close(fast[s, j, k], want.float(), rtol=1e-4, atol=1e-4)


def test_pooled_features_and_the_verify_length():
    h = torch.randn(5, 16, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(pooled(h).double(), pooled_reference(h), rtol=1e-5, atol=1e-6)
    assert [verify_length(r, 7, 1) for r in (0.0, 0.2, 0.5, 0.99)] == [1, 2, 5, 7]
    assert [verify_length(r, 7, 0) for r in (0.0, 0.3, 1.0)] == [1, 2, 7]


@pytest.fixture(scope="module")
def trained(target, tmp_path_factory):
    """An OPD run from scratch (6 steps), then a length-head run on its head (4 steps)."""
    root = tmp_path_factory.mktemp("adaflash-train")
    rng = random.Random(5)
    data = write_jsonl(root / "d.jsonl", [{"text": words(rng, SEQ)} for _ in range(4)])
    kw = dict(head="dflash", block_size=4, anchors=6, draft_vocab=None, layers=1)
    train(options(target, data, root / "opd", steps=6, lr=3e-3, warmup_steps=0, objective="opd", **kw),
          log=lambda m: None)
    train(options(target, data, root / "len", steps=4, lr=1e-2, warmup_steps=0, objective="length",
                  init_from=str(root / "opd"), **kw), log=lambda m: None)
    return root


def test_opd_lowers_its_reverse_kl_and_logs_the_accepted_length(trained):
    log = log_of(trained / "opd")
    assert log[-1]["loss"] < log[0]["loss"], [r["loss"] for r in log]
    assert len(log[-1]["step_acc"]) == 3 and 0 <= log[-1]["accepted"] <= 3


def test_the_length_run_keeps_the_head_and_writes_the_length_head(trained, target):
    from safetensors.torch import load_file

    before, after = load_file(str(trained / "opd" / "model.safetensors")), load_file(str(trained / "len" /
                                                                                      "model.safetensors"))
    for name, value in before.items():  # frozen: only the input scale's fold may move fc by rounding
        torch.testing.assert_close(after[name], value, rtol=1e-5, atol=1e-6)
    log = log_of(trained / "len")
    assert len(log[-1]["step_acc"]) == 1 and log[-1]["rows"] > 0
    head = LengthHead.load(trained / "len" / FILE)
    assert head.block_size == 4
    entry, argument = parse_drafter(f"adaflash:{trained / 'len'},margin=0")
    drafter = entry.build(argument, parse_shape("chain"), load_decoder(target, "cpu"), target)
    assert isinstance(drafter, AdaFlashDrafter) and drafter.length is not None and drafter.margin == 0


def _speculator(small, length, depth=4):
    h = random_head(hidden=64, vocab=8, layers=2, heads=4, kv_heads=2, block=5, taps=3, seed=3,
                    embed=small.embed, lm_head=small.lm_head, mask_token_id=0)
    drafter = AdaFlashDrafter(h, parse_shape("chain"), h.config.taps(small.config.num_layers), length, margin=0)
    spec = Speculator(SpecOptions("adaflash:x", "chain", f"fixed:{depth}"), drafter, FixedController(depth),
                      parse_shape("chain"))
    return spec, drafter


@pytest.mark.parametrize("bias", [-2.0, 0.0, 3.0])
def test_the_length_head_cuts_blocks_and_greedy_equals_plain(small, bias):
    length = LengthHead(64, width=8, block_size=5, seed=1)
    with torch.no_grad():
        length.out.weight.mul_(300.0)  # lengths that vary with the block
        length.out.bias.fill_(bias)
    spec, drafter = _speculator(small, length)
    drafted = []
    original = drafter._tree

    def spy(st, block, tokens, budget):
        tree = original(st, block, tokens, budget)
        drafted.append((len(tree.tokens) - 1, drafter.verified[-1]))
        return tree

    drafter._tree = spy
    requests = lambda: [Request(list(p), 16, SamplingParams()) for p in PROMPTS]  # noqa: E731
    plain = [f.token_ids for f in generate_ids(small, requests(), set())]
    got = [f.token_ids for f in generate_ids(small, requests(), set(), speculation=spec)]
    assert got == plain
    assert drafted and all(n <= keep for n, keep in drafted)  # the cut holds every round
    assert min(n for n, _ in drafted) < 4  # and it cut some blocks below the controller's depth


def test_sampled_output_is_reproducible_with_the_cut(small):
    length = LengthHead(64, width=8, block_size=5, seed=1)
    params = SamplingParams(temperature=0.8, seed=11)
    outs = [[f.token_ids for f in generate_ids(small, [Request(list(p), 12, params) for p in PROMPTS], set(),
                                               speculation=_speculator(small, length)[0])] for _ in range(2)]
    assert outs[0] == outs[1]


def test_bad_options_are_one_line_errors(tmp_path, target):
    with pytest.raises(ConfigError, match="no AdaFlash length head"):
        parse_drafter("adaflash:smollm2-135m-instruct,length=" + str(tmp_path / "none.safetensors"))
    with pytest.raises(ConfigError, match="margin"):
        parse_drafter("adaflash:smollm2-135m-instruct,margin=x")
    with pytest.raises(ConfigError, match="--init-from"):
        options(target, tmp_path / "d.jsonl", tmp_path / "o", head="dflash", objective="length").check()
    with pytest.raises(ConfigError, match="DFlash"):
        options(target, tmp_path / "d.jsonl", tmp_path / "o", objective="opd").check()
    with pytest.raises(ConfigError, match="objective"):
        options(target, tmp_path / "d.jsonl", tmp_path / "o", head="dflash", objective="rl").check()


def test_the_shipped_length_head_is_found_by_name_and_small_with_its_recipe():
    import json

    from outrider.drafters.adaflash import SHIPPED

    folder = SHIPPED / "smollm2-135m-instruct"
    _, argument = parse_drafter("adaflash:smollm2-135m-instruct")
    assert f"length={folder / FILE}" in argument
    assert (folder / FILE).stat().st_size <= 25 * 1024 * 1024 and LengthHead.load(folder / FILE).block_size == 8
    recipe = json.loads((folder / "recipe.json").read_text())
    assert recipe["seed"] == 0 and "--objective" in recipe["command"] and recipe["tokens"] > 0
    _, off = parse_drafter("adaflash:smollm2-135m-instruct,length=off")
    assert "length=off" in off
