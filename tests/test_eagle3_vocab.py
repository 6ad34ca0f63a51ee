"""`eagle3:NAME,vocab=N` (heads/eagle3/vocab.py, issue 30 item 4): the head's readout cut to the
draft tokens among target ids 0..N-1 gives the same logits for the tokens it keeps and none for
the others, in float and quantized heads; greedy output stays the target's; bad values get one line."""

import pytest
import torch
from eagle3_tiny import target_with_head, write_eagle3
from enumerate_law import one_thread

from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.errors import ConfigError
from outrider.heads.eagle3.format import load_eagle3
from outrider.weights.loader import load_decoder

PROMPTS = [[3, 4, 5, 3, 4, 5, 3], [6, 7, 3, 6, 7, 3, 6], [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4]]


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The vocab-8 target and its head of 6 draft tokens (target ids 0, 1, 2, 3, 5, 7)."""
    folder, head = target_with_head(tmp_path_factory.mktemp("e3vocab"))
    return folder, load_decoder(folder, "cpu"), head


def test_the_cut_readout_keeps_the_same_logits_for_the_tokens_it_keeps(setup):
    folder, target, head = setup
    full = load_eagle3(head, target)
    cut = load_eagle3(head, target, vocab=torch.arange(4))  # target ids 0..3: draft ids 0..3
    assert cut.config.draft_vocab_size == 4 and cut.w.draft_to_target.tolist() == [0, 1, 2, 3]
    h = torch.randn(5, full.config.hidden_size)
    full_logits = full.target_logits(full._out(h.unsqueeze(0), None)[0][0])  # [5, V]
    cut_logits = cut.target_logits(cut._out(h.unsqueeze(0), None)[0][0])
    torch.testing.assert_close(cut_logits[:, :4], full_logits[:, :4], rtol=1e-5, atol=1e-6)  # a GEMM's order
    assert torch.isinf(cut_logits[:, 4:]).all()  # no other token is proposed
    for row in range(5):  # greedy: the full head's best among the kept tokens
        assert cut.greedy_token(cut._out(h[row].view(1, 1, -1), None)[0][0, 0]) == int(full_logits[row, :4].argmax())
    # kept ids that are not a prefix of the draft vocabulary (a tokenizer's added tokens sit high)
    gaps = load_eagle3(head, target, vocab=torch.tensor([1, 5, 6]))  # 6 is not a draft token
    assert gaps.w.draft_to_target.tolist() == [1, 5]
    gap_logits = gaps.target_logits(gaps._out(h.unsqueeze(0), None)[0][0])
    torch.testing.assert_close(gap_logits[:, [1, 5]], full_logits[:, [1, 5]], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("argument", ["vocab=4", "@q8_0,vocab=4", "vocab=100"])
@pytest.mark.parametrize("tree", ["chain", "dynamic:3,8"])
def test_greedy_output_equals_autoregressive(setup, argument, tree):
    folder, target, head = setup
    spec = Speculator.build(SpecOptions(f"eagle3:{head}{'' if argument.startswith('@') else ','}{argument}",
                                        tree, "fixed:3"), target, folder)
    expected = 6 if argument == "vocab=100" else 4  # 100 keeps every draft token
    assert spec.drafter.head.config.draft_vocab_size == expected
    assert ",vocab=" in spec.drafter.name
    requests = lambda: [Request(list(p), 16) for p in PROMPTS]  # noqa: E731
    fast = generate_ids(target, requests(), set(), speculation=spec)
    plain = generate_ids(target, requests(), set())
    assert [f.token_ids for f in fast] == [f.token_ids for f in plain]
    assert sum(f.round_stats.committed for f in fast) > sum(f.round_stats.rounds for f in fast)  # drafts accepted


def test_bad_values_get_one_line(setup, tmp_path):
    import json

    from outrider.drafters.eagle3 import parse_argument

    folder, target, head = setup
    for bad in ("0", "x", "-3"):
        with pytest.raises(ConfigError, match=r"vocab=.*positive number of token ids, as in eagle3:NAME,vocab=8192"):
            parse_argument(f"{head},vocab={bad}")
    assert parse_argument(f"{head},vocab=4") == f"{head},vocab=4"
    odd = write_eagle3(tmp_path / "odd", json.loads((folder / "config.json").read_text()), draft_vocab=4,
                       layer_ids=[0, 1, 2], semantics="sglang")  # draft tokens: target ids 1, 3, 5, 7
    with pytest.raises(ConfigError, match="none of this head's 4 draft tokens is among the kept ids"):
        Speculator.build(SpecOptions(f"eagle3:{odd},vocab=1", "chain", "fixed:2"), target, folder)
