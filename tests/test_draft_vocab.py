"""A draft model with a reduced output head (`draft-model:NAME,vocab=N`): its logits are the full
head's columns for the kept tokens, it proposes no other token, its sampled q is zero outside
them, and the output stays the target's (greedy here; sampled in test_spec_sampling_exact)."""

import pytest
import torch
from test_spec_greedy_equal import SHAPES, plain, run, speculator, target  # noqa: F401 (fixtures)

from outrider.drafters.draft_model import DraftModel, draft_vocab_ids, parse_argument
from outrider.drafters.model import ModelDrafter
from outrider.errors import ConfigError, ModelError
from outrider.models.batch import pack
from outrider.weights.loader import load_decoder
from outrider.sampling import SamplingParams
from outrider.spec.shapes import parse_shape

KEPT = torch.tensor([0, 2, 5, 6, 7] + list(range(10, 60, 3)) + [95])  # sorted, not a prefix


def test_parse_vocab_option():
    assert parse_argument("m,vocab=64") == DraftModel("m", None, 64)
    assert parse_argument("m@q4_0,vocab=65536") == DraftModel("m", "q4_0", 65536)
    assert str(DraftModel("m", "q4_0", 65536)) == "m@q4_0,vocab=65536"
    assert parse_argument(str(DraftModel("m", "q4_0", 7))) == DraftModel("m", "q4_0", 7)
    for bad in ("m,vocab=0", "m,vocab=x", "m,vocab=", "m@q4_0,vocab=-3"):
        with pytest.raises(ConfigError, match="vocab="):
            parse_argument(bad)


def test_draft_vocab_ids_keep_the_added_tokens(tiny_folders, tmp_path):
    ids = draft_vocab_ids(tiny_folders["llama-draft"], 40, 96).tolist()
    assert ids == list(range(40))  # the tiny tokenizer's added tokens are ids 0..2
    (tmp_path / "tokenizer.json").write_text('{"added_tokens": [{"id": 90}, {"id": 3}, {"id": 200}]}')
    assert draft_vocab_ids(tmp_path, 5, 96).tolist() == [0, 1, 2, 3, 4, 90]  # 200: past the limit


@pytest.mark.parametrize("dtype", [None, "q8_0"])
@pytest.mark.parametrize("folder", ["llama-draft", "llama-tied"])
def test_reduced_head_gives_the_full_heads_columns(tiny_folders, dtype, folder):
    full = load_decoder(tiny_folders[folder], "cpu", dtype)
    reduced = load_decoder(tiny_folders[folder], "cpu", dtype, head_ids=KEPT)
    assert reduced.head_ids is KEPT and full.head_ids is None
    logits = []
    for model in (full, reduced):
        cache = model.new_cache(1, 32)
        batch = pack([0], [0], [torch.tensor([1, 5, 9, 30, 4])], logits="all", scratch_row=cache.scratch_row)
        logits.append(model.forward(batch, cache).logits[0])  # [5, vocab or len(KEPT)]
    assert logits[1].shape == (5, len(KEPT))
    torch.testing.assert_close(logits[1], logits[0][:, KEPT], rtol=0, atol=1e-5)


def test_head_ids_out_of_range_are_refused(tiny_folders):
    with pytest.raises(ModelError, match="head_ids"):
        load_decoder(tiny_folders["llama-draft"], "cpu", head_ids=torch.tensor([3, 96]))


@pytest.mark.parametrize("shape", SHAPES)
def test_reduced_vocab_keeps_greedy_output_and_drafts_only_kept_tokens(tiny_folders, target, plain, shape):
    draft = load_decoder(tiny_folders["llama-draft"], "cpu", head_ids=KEPT)
    drafter = ModelDrafter(draft, parse_shape(shape), name="draft-model:tiny,vocab")
    proposed = []
    propose = drafter.propose_batch

    def spy(*args):
        trees = propose(*args)
        proposed.extend(t for tree in trees for t in tree.tokens[1:].tolist())
        return trees

    drafter.propose_batch = spy
    assert run(target, speculator(drafter, shape)) == plain
    assert proposed and set(proposed) <= set(KEPT.tolist())


def test_sampled_q_is_zero_outside_the_kept_tokens(tiny_folders):
    draft = load_decoder(tiny_folders["llama-draft"], "cpu", head_ids=KEPT)
    drafter = ModelDrafter(draft, parse_shape("chain"), name="draft-model:tiny,vocab")
    q = drafter._q(torch.randn(3, len(KEPT)), SamplingParams(temperature=0.7))  # [3, 96]
    assert q.shape == (3, 96)
    torch.testing.assert_close(q.sum(-1), torch.ones(3))
    outside = torch.ones(96, dtype=torch.bool)
    outside[KEPT] = False
    assert (q[:, outside] == 0).all() and (q[:, KEPT] > 0).all()
