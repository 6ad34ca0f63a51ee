"""The Matryoshka nested suite (issue 44 item 5): slices share the one weight set, the joint loss's terms,
the engine's slice decoder equals the trained slice, greedy speculation with the smallest slice drafting
equals plain decoding, and the shipped suite loads (docs/methods.md#matryoshka)."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from enumerate_law import one_thread

from outrider.drafters.matryoshka import check_fits, parse_argument
from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.errors import ConfigError, ModelError
from outrider.models.batch import pack
from outrider.models.config import ModelConfig
from outrider.models.matryoshka import Slice, parse_slices, slice_decoder, slices_of
from outrider.sampling import SamplingParams
from outrider.train.matryoshka_model import NestedLM, joint_loss
from outrider.weights.loader import load_decoder

SLICES = [Slice(1, 2, 16), Slice(2, 3, 32), Slice(3, 4, 48)]
SHIPPED = Path(__file__).resolve().parent.parent / "outrider" / "models" / "shipped" / "matryoshka-code-3"


def tiny(seed: int = 0) -> NestedLM:
    """A tiny suite whose weights are far from uniform (so the slices disagree), the largest's extra
    heads, neurons and layers damped so that its smallest slice drafts it fairly well."""
    torch.manual_seed(seed)
    m = NestedLM(vocab=48, hidden=32, layers=3, heads=4, head_dim=8, ffn=48, seed=seed)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.mul_(8.0)
        for i, b in enumerate(m.blocks):
            for name in ("q", "k", "v", "gate", "up"):
                getattr(b, name)[16:].mul_(0.3)  # past 2 heads of 8, past 16 neurons
            if i == 2:
                b.o.mul_(0.2)
                b.down.mul_(0.2)
    return m


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    folder = tmp_path_factory.mktemp("matryoshka")
    model = tiny()
    model.save(folder, SLICES)
    return folder, model


def by_hand(big: NestedLM, s: Slice) -> NestedLM:
    """The largest model truncated by hand: a model of slice s's size with the prefix weights copied."""
    small = NestedLM(big.vocab, big.hidden, s.layers, s.heads, big.head_dim, s.ffn)
    D = big.head_dim
    with torch.no_grad():
        small.embed.copy_(big.embed)
        small.norm.copy_(big.norm)
        for a, b in zip(small.blocks, big.blocks):
            a.input_norm.copy_(b.input_norm)
            a.post_norm.copy_(b.post_norm)
            for name in ("q", "k", "v"):
                getattr(a, name).copy_(getattr(b, name)[: s.heads * D])
            a.o.copy_(b.o[:, : s.heads * D])
            a.gate.copy_(b.gate[: s.ffn])
            a.up.copy_(b.up[: s.ffn])
            a.down.copy_(b.down[:, : s.ffn])
    return small


TOKENS = torch.tensor([[3, 17, 5, 40, 2, 9, 9, 31, 12, 7]])


def test_a_slice_is_the_largest_truncated_by_hand():
    big = tiny()
    with torch.no_grad():
        for s in SLICES:
            assert torch.allclose(big(TOKENS, s), by_hand(big, s)(TOKENS), atol=1e-5)
        # the slices differ from each other (a forward that ignored the slice would pass the above
        # only for the largest)
        assert not torch.allclose(big(TOKENS, SLICES[0]), big(TOKENS), atol=1e-2)


def _logits(decoder, tokens: list[int]) -> torch.Tensor:
    cache = decoder.new_cache(1, 32)
    batch = pack([0], [0], [torch.tensor(tokens)], logits="all", scratch_row=cache.scratch_row)
    return decoder.forward(batch, cache).logits[0]  # [T, V]


def test_the_engine_runs_each_slice_as_trained(suite):
    folder, model = suite
    assert slices_of(folder) == SLICES
    target = load_decoder(folder, "cpu", torch.float32)
    tokens = TOKENS[0].tolist()
    with torch.no_grad():
        assert torch.allclose(_logits(target, tokens), model(TOKENS)[0], atol=1e-4)
        for s in SLICES[:-1]:
            sliced = slice_decoder(target, s)
            assert sliced.config.num_layers == s.layers and sliced.config.num_heads == s.heads
            assert sliced.embed is target.embed  # the one weight set: the table is the target's own
            assert torch.allclose(_logits(sliced, tokens), model(TOKENS, s)[0], atol=1e-4)


def test_the_joint_loss_is_ce_per_slice_plus_distillation():
    model = tiny()
    mask = torch.ones_like(TOKENS, dtype=torch.bool)
    mask[0, :4] = False  # the first labels out
    total, terms = joint_loss(model, TOKENS, mask, SLICES, [1.0, 0.5, 2.0], kd=0.7, temperature=2.0)
    keep = mask[0, 1:]
    ce, logp = [], []
    with torch.no_grad():
        for s in SLICES:
            lg = model(TOKENS[:, :-1], s)[0]
            ce.append(float(F.cross_entropy(lg[keep], TOKENS[0, 1:][keep])))
            logp.append(F.log_softmax(lg[keep] / 2.0, -1))
    kl = [float((logp[-1].exp() * (logp[-1] - lp)).sum(-1).mean()) for lp in logp[:-1]]
    assert terms["ce"] == pytest.approx(ce, rel=1e-5)
    assert terms["kl"] == pytest.approx(kl, rel=1e-4, abs=1e-6)
    assert float(total.detach()) == pytest.approx(ce[0] + 0.5 * ce[1] + 2.0 * ce[2] + 0.7 * 4.0 * sum(kl), rel=1e-5)
    # the teacher is detached: a tensor only the largest slice uses (its third layer) gets the
    # gradient of its own cross-entropy alone
    total.backward()
    only_big = model.blocks[2].down.grad.clone()
    model.zero_grad()
    (2.0 * joint_loss(model, TOKENS, mask, SLICES[-1:], [1.0], kd=0.0)[0]).backward()
    assert torch.allclose(only_big, model.blocks[2].down.grad, atol=1e-6)
    assert joint_loss(model, TOKENS, mask, SLICES, [1.0] * 3, kd=0.0)[1]["kl"] == []


@one_thread()
def test_greedy_speculation_with_the_smallest_slice_equals_plain(suite):
    folder, _ = suite
    target = load_decoder(folder, "cpu", torch.float32)
    prompts = [[3, 17, 5, 40], [9, 9, 31, 12, 7, 1], [44]]

    def run(spec):
        return generate_ids(target, [Request(list(p), 24, SamplingParams()) for p in prompts], set(), speculation=spec)

    plain = run(None)
    for k, tree in ((1, "chain"), (2, "static:2,2")):
        spec = Speculator.build(SpecOptions(f"matryoshka:{k}", tree, "fixed:3"), target, folder)
        fast = run(spec)
        assert [f.token_ids for f in fast] == [f.token_ids for f in plain]
        assert sum(f.round_stats.committed for f in fast) > sum(f.round_stats.rounds for f in fast)  # drafts accepted


def test_bad_suites_and_arguments_are_refused(suite, tmp_path):
    folder, _ = suite
    config = ModelConfig.load(folder)
    assert parse_argument("") == 1 and parse_argument("2") == 2
    with pytest.raises(ConfigError, match="K >= 1"):
        parse_argument("0")
    assert "below 3" in check_fits(3, config, folder)
    assert check_fits(2, config, folder) is None
    raw = json.loads((folder / "config.json").read_text())
    assert "not a Matryoshka suite" in check_fits(1, config, _write(tmp_path / "a", {**raw, "matryoshka": None}))
    with pytest.raises(ModelError, match="not nested"):
        parse_slices({**raw, "matryoshka": {"slices": [SLICES[1].to_json(), SLICES[0].to_json(), SLICES[2].to_json()]}})
    with pytest.raises(ModelError, match="model's own size"):
        parse_slices({**raw, "matryoshka": {"slices": [s.to_json() for s in SLICES[:2]]}})


def _write(folder: Path, raw: dict) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({k: v for k, v in raw.items() if v is not None}))
    return folder


@pytest.mark.skipif(not SHIPPED.is_dir(), reason="no shipped suite in this tree")
def test_the_shipped_suite_loads_and_its_files_are_small():
    recipe = json.loads((SHIPPED / "recipe.json").read_text())
    assert all(p.stat().st_size <= 25 * 2**20 for p in SHIPPED.iterdir())
    target = load_decoder(SHIPPED, "cpu", torch.float32)
    slices = slices_of(SHIPPED)
    assert len(slices) == 3 and [s.to_json() for s in slices] == recipe["slices"]
    small = slice_decoder(target, slices[0])
    assert _logits(small, [1604, 275, 24, 104]).shape == (4, target.config.vocab_size)


def test_the_tokenizer_cut_keeps_the_first_ids_and_the_merges_among_them():
    from outrider.train.cut_vocab import cut_tokenizer_json

    vocab = {"<s>": 0, "a": 1, "b": 2, "c": 3, "ab": 4, "abc": 5, "bc": 6}
    raw = {"added_tokens": [{"id": 0, "content": "<s>"}],
           "model": {"type": "BPE", "vocab": vocab, "merges": [["a", "b"], ["ab", "c"], ["b", "c"]]}}
    cut = cut_tokenizer_json(raw, 5)
    assert cut["model"]["vocab"] == {t: i for t, i in vocab.items() if i < 5}
    assert cut["model"]["merges"] == [["a", "b"]]  # "abc" (5) and "bc" (6) are cut with their merges
    assert cut_tokenizer_json(raw, 7)["model"]["merges"] == raw["model"]["merges"]
    with pytest.raises(ConfigError, match="adds tokens"):
        cut_tokenizer_json({**raw, "added_tokens": [{"id": 6, "content": "bc"}]}, 5)
    with pytest.raises(ConfigError, match="BPE"):
        cut_tokenizer_json({**raw, "model": {"type": "Unigram"}}, 5)
    with pytest.raises(ConfigError, match="byte symbols"):  # a byte symbol the original has must stay
        cut_tokenizer_json({**raw, "model": {**raw["model"], "vocab": {**vocab, "d": 7}}}, 5)
