"""Windowed-MTP (issue 26, item 4): `window=W,sink=S` on draft models and EAGLE-3 heads.

The windowed drafter's forwards equal a slow reference: one forward over the whole sequence,
from an empty cache, whose mask is written out pair by pair from the rule (a query at position p
sees keys at positions < S or > p - W, causally) - so the chunked prefill, the reclaimed rows,
the shifted rotary positions and the tree masks change nothing but what the rule says. The
greedy output equals autoregressive output with windows smaller than the prompts (tiny models
and SmolLM2-135M), the drafter's cache stays bounded, and bad options are refused in one line.
"""

from dataclasses import replace

import pytest
import torch
from eagle3_tiny import target_with_head
from enumerate_law import one_thread

from outrider.control.controllers import FixedController
from outrider.drafters.model import ModelDrafter
from outrider.drafters.registry import parse_drafter
from outrider.drafters.window import Window
from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.errors import ConfigError
from outrider.models.batch import pack
from outrider.spec.shapes import parse_shape
from outrider.spec.types import Budget
from outrider.weights.loader import load_decoder

SHAPES = ["chain", "static:2,2,1", "dynamic:3,8"]


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    with one_thread():
        yield


def prompts():
    g = torch.Generator().manual_seed(5)
    base = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (1, 7, 40)]
    return base + [[10, 11, 12, 13] * 10]  # a repeat, so the drafts are often right


def run(target, spec=None, n=16):
    requests = [Request(list(p), n) for p in prompts()]
    return [f.token_ids for f in generate_ids(target, requests, set(), speculation=spec)]


def rule(positions: list[int], window: Window) -> torch.Tensor:
    """The slow reference's mask [1, 1, n, n]: query i sees key j <= i when j < S or j > i - W."""
    n = len(positions)
    mask = torch.zeros(1, 1, n, n, dtype=torch.bool)
    for i in range(n):
        for j in range(i + 1):
            mask[0, 0, i, j] = positions[j] < window.sink or positions[j] > positions[i] - window.window
    return mask


@pytest.fixture(scope="module")
def target(tiny_folders):
    return load_decoder(tiny_folders["llama"], "cpu")


@pytest.fixture(scope="module")
def plain(target):
    return run(target)


# -- the mask and the forwards against the slow reference ----------------------------------------
def test_the_packed_mask_is_the_rule_for_trees_shifts_and_padding():
    window = Window(3, 2)
    parents = torch.tensor([-1, 0, 0, 1, 2, 3])
    batch = pack([0, 1], [9, 4], [torch.tensor([5, 6, 7]), torch.tensor([1])], [parents, None],
                 scratch_row=30, first_nodes=[3, 0], shifts=[5, 0], window=(2, 3))
    assert batch.positions[0].tolist() == [9 + 5 + 2, 9 + 5 + 2, 9 + 5 + 3]  # nodes 3, 4, 5 at depths 2, 2, 3
    assert batch.positions[1, 0] == 4  # no shift, no tree
    node_pos = [14, 15, 15, 16, 16, 17]  # the tree's nodes at rows 9..14
    keys = [r if r < 2 else r + 5 for r in range(9)] + node_pos  # rows 0..14 of slot 0
    ancestors = {3: {0, 1, 3}, 4: {0, 2, 4}, 5: {0, 1, 3, 5}}
    for t, node in enumerate((3, 4, 5)):
        p = node_pos[node]
        for col in range(batch.kv_len):
            seen = (col < 9 or col - 9 in ancestors[node]) and col < 15
            want = seen and (keys[col] < 2 or keys[col] > p - 3)
            assert bool(batch.attn_mask[0, 0, t, col]) == want, (t, col)
    assert batch.attn_mask[1, 0, 0].tolist()[:6] == [True] * 5 + [False]  # position 4: the sink 0, 1 and 2..4
    with pytest.raises(ValueError, match="shifts come with a window"):
        pack([0], [3], [torch.tensor([1])], shifts=[2])


def test_a_windowed_draft_model_equals_full_attention_over_the_kept_keys(target, monkeypatch):
    """Prefill in chunks with rows reclaimed, a catch-up, a chain: the drafts, the kept K/V rows
    and the logits of a tree forward equal one forward over the whole sequence masked by the rule."""
    window = Window(5, 2)
    drafter = ModelDrafter(target, parse_shape("chain"), window=window)
    monkeypatch.setattr(Window, "chunk", property(lambda self: 7))  # several prefill forwards, rows reclaimed between
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 96, (60,), generator=g).tolist()
    drafter.start(0, prompt)
    st = drafter._states[0]
    assert st.shift > 0 and drafter.cache.lengths[st.slot] <= 2 + 4 + window.slack + 7
    tree = drafter.propose(0, prompt, Budget(3, 3))
    sequence = prompt + tree.tokens[1:].tolist()
    n = len(sequence)
    cache = target.new_cache(1, n)
    batch = pack([0], [0], [torch.tensor(sequence)], scratch_row=n, logits="all")
    batch = replace(batch, attn_mask=rule(list(range(n)), window))
    full = target.forward(batch, cache).logits[0]  # [n, vocab]
    with torch.inference_mode():
        for d in range(1, 4):  # the draft at depth d is the argmax after position len(prompt) + d - 2
            assert tree.tokens[d] == int(full[len(prompt) + d - 2].argmax())
        rows = drafter.cache.lengths[st.slot]  # the committed rows: sink, then the live window
        kept = list(range(2)) + list(range(len(prompt) - 1 - (rows - 2), len(prompt) - 1))
        for layer in range(target.config.num_layers):
            assert torch.allclose(drafter.cache.k[layer][st.slot, :, :rows], cache.k[layer][0, :, kept], atol=1e-5)
            assert torch.allclose(drafter.cache.v[layer][st.slot, :, :rows], cache.v[layer][0, :, kept], atol=1e-5)
    from outrider.drafters.grow import Feed

    logits = drafter._forward([st], [Feed(tree.tokens.tolist(), tree.parents.tolist(), 0)])[0]  # root and drafts again
    assert torch.allclose(logits, full[len(prompt) - 1 : len(prompt) + 3], atol=1e-4)


def test_a_windowed_head_equals_full_attention_over_the_kept_keys(tmp_path, monkeypatch):
    from outrider.drafters.eagle3 import Eagle3Drafter
    from outrider.heads.eagle3.format import load_eagle3

    folder, head_folder = target_with_head(tmp_path)
    tgt = load_decoder(folder, "cpu")
    head = load_eagle3(head_folder, tgt)
    window = Window(4, 1)
    drafter = Eagle3Drafter(head, parse_shape("chain"), (1, 2, 3), window=window)
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, 8, (50,), generator=g).tolist()
    features = torch.randn(len(prompt) - 1, 3, tgt.config.hidden_size, generator=g)
    monkeypatch.setattr(Window, "chunk", property(lambda self: 6))
    drafter.start(0, prompt, hidden=features)
    st = drafter._states[0]
    assert st.shift > 0 and st.rows == len(prompt) - 1
    n = len(prompt) - 1  # rows p = 0..n-1: feature p, token p + 1
    cache = head.new_cache(1, n)
    batch = replace(pack([0], [0], [torch.tensor(prompt[1:])], scratch_row=n), attn_mask=rule(list(range(n)), window))
    logits, hidden = head.forward(batch, cache, head.fuse(features).unsqueeze(0))
    assert torch.allclose(st.last_logits, logits[0, -1], atol=1e-4)
    assert torch.allclose(st.last_hidden, hidden[0, -1], atol=1e-4)
    rows = drafter.cache.lengths[st.slot]
    kept = [0] + list(range(n - (rows - 1), n))
    assert torch.allclose(drafter.cache.k[0][st.slot, :, :rows], cache.k[0][0, :, kept], atol=1e-5)
    # full attention over the same rows differs: the window restricts something here
    full = head.forward(pack([0], [0], [torch.tensor(prompt[1:])], scratch_row=n), head.new_cache(1, n),
                        head.fuse(features).unsqueeze(0))[0]
    assert not torch.allclose(full[0, -1], logits[0, -1], atol=1e-3)


# -- lossless: greedy output is autoregressive output -------------------------------------------
@pytest.mark.parametrize("shape", SHAPES)
def test_windowed_draft_model_greedy_equals_autoregressive(target, plain, tiny_folders, shape):
    spec = Speculator.build(SpecOptions(f"draft-model:{tiny_folders['llama-draft']},window=4,sink=2", shape,
                                        "fixed:4"), target, tiny_folders["llama"])
    assert spec.drafter.window == Window(4, 2)
    assert run(target, spec) == plain


@pytest.mark.parametrize("shape", SHAPES)
def test_windowed_eagle3_greedy_equals_autoregressive(tmp_path_factory, shape):
    folder, head = target_with_head(tmp_path_factory.mktemp("win-e3"))
    tgt = load_decoder(folder, "cpu")
    spec = Speculator.build(SpecOptions(f"eagle3:{head},window=3,sink=1", shape, "fixed:3"), tgt, folder)
    assert spec.drafter.window == Window(3, 1) and spec.drafter.name.endswith(",window=3,sink=1")
    ar = [f.token_ids for f in generate_ids(tgt, [Request([1, 2, 3, 4, 5, 6, 7] * 4, 16)], set())]
    sp = [f.token_ids for f in generate_ids(tgt, [Request([1, 2, 3, 4, 5, 6, 7] * 4, 16)], set(), speculation=spec)]
    assert sp == ar


def test_the_draft_cache_stays_bounded(tmp_path):
    """A 600-token prompt and 40 more: the windowed drafter's slot never grows past its first
    256 rows, the full-attention one's grows past the context."""
    from tiny import make_tiny

    target = load_decoder(make_tiny("llama", tmp_path / "long", layers=1, max_positions=1024), "cpu")
    prompt = (list(range(3, 90)) * 7)[:600]
    sizes = {}
    for window in (None, Window(16, 4)):
        drafter = ModelDrafter(target, parse_shape("chain"), window=window)
        spec = Speculator(SpecOptions("draft-model", "chain", "fixed:4"), drafter, FixedController(4),
                          parse_shape("chain"))
        generate_ids(target, [Request(list(prompt), 40)], set(), speculation=spec, max_len=1024)
        sizes[window] = drafter.cache_rows
    assert sizes[None] >= 640 and sizes[Window(16, 4)] == 256


# -- one-line refusals, before anything loads ----------------------------------------------------
@pytest.mark.parametrize("text, message", [
    ("draft-model:m,window=-1", "window='-1': give a whole number of tokens >= 1, as in draft-model:NAME,window=256,sink=4"),
    ("draft-model:m,window=0", "window=0: the window holds the query itself, so give window >= 1, as in "
                               "draft-model:NAME,window=256,sink=4"),
    ("draft-model:m,window=8,sink=-2", "sink='-2': give a whole number of tokens >= 0, as in "
                                       "draft-model:NAME,window=256,sink=4"),
    ("draft-model:m,sink=4", "sink=4 needs a window: draft-model:NAME,window=W,sink=4"),
    ("eagle3:NAME,window=x", "window='x': give a whole number of tokens >= 1, as in eagle3:NAME,window=256,sink=4"),
    ("eagle3:NAME,window=4,window=8", "window= is given twice"),
    ("suffix:window=256", "window=/sink= restrict a drafter's own attention, and suffix has none of its own to "
                          "restrict; they apply to draft-model, eagle3"),
    ("ngram:window=8,sink=2", "window=/sink= restrict a drafter's own attention, and ngram has none of its own to "
                              "restrict; they apply to draft-model, eagle3"),
    ("early-exit:2,window=8", "window=/sink= restrict a drafter's own attention, and early-exit has none of its "
                              "own to restrict; they apply to draft-model, eagle3"),
])
def test_bad_options_are_refused_in_one_line(text, message):
    with pytest.raises(ConfigError) as error:
        SpecOptions(text).check()
    assert str(error.value) == f"--drafter {text!r}: {message}"


def test_a_window_past_the_context_does_not_fit(tiny_folders):
    from outrider.models.config import ModelConfig

    config = ModelConfig.load(tiny_folders["llama"])
    context = config.max_position_embeddings
    options = SpecOptions(f"draft-model:{tiny_folders['llama-draft']},window={context},sink=1")
    assert options.misfit(config, tiny_folders["llama"]) == (
        f"window={context} plus sink=1 is more than the target's context of {context} tokens, so it would "
        "never restrict anything; give a smaller window")
    assert SpecOptions(f"draft-model:{tiny_folders['llama-draft']},window={context - 1},sink=1").misfit(
        config, tiny_folders["llama"]) is None


def test_the_cli_refuses_before_the_model_loads(capsys):
    from outrider.cli import main

    assert main(["generate", "--model", "no-such-model", "--drafter", "suffix,window=4", "hi"]) == 2
    assert main(["generate", "--model", "no-such-model", "--drafter", "draft-model:m,window=-4", "hi"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert lines[0].startswith("error: --drafter 'suffix,window=4'")
    assert lines[1] == ("error: --drafter 'draft-model:m,window=-4': window='-4': give a whole number of tokens "
                        ">= 1, as in draft-model:NAME,window=256,sink=4")


def test_arguments_read_back():
    entry, arg = parse_drafter("draft-model:m@q4_0,window=256,sink=4,vocab=64")
    assert (arg.name, arg.dtype, arg.vocab, arg.window) == ("m", "q4_0", 64, Window(256, 4))
    assert str(arg) == "m@q4_0,vocab=64,window=256,sink=4"
    assert parse_drafter(f"draft-model:{arg}")[1] == arg
    assert parse_drafter("draft-model:m,window=8")[1].window == Window(8, 0)


# -- SmolLM2-135M --------------------------------------------------------------------------------
CODE = "def is_prime(n):\n    \"\"\"Return True if n is a prime number.\"\"\"\n    if n < 2:\n        return False\n"


@pytest.mark.model
@pytest.mark.parametrize("drafter", ["eagle3"])  # a windowed draft model: the tiny models' tests
def test_smollm2_windowed_greedy_output_is_autoregressive(smollm2_decoder, smollm2_tokenizer, drafter):
    from outrider.drafters.eagle3 import Eagle3Drafter
    from outrider.heads.catalog import resolve_head
    from outrider.heads.eagle3.format import load_eagle3

    target = smollm2_decoder
    window = Window(16, 4)  # the prompt is ~70 tokens: the window restricts the draft
    shape = parse_shape("chain")
    if drafter == "eagle3":
        head = load_eagle3(resolve_head("smollm2-135m-instruct"), target)
        made = Eagle3Drafter(head, shape, head.config.taps(target.config.num_layers), window=window)
    else:  # the target as its own draft model, in a cache of its own: windowed, it is another model
        made = ModelDrafter(target, shape, window=window)
    spec = Speculator(SpecOptions(drafter, "chain", "fixed:4"), made, FixedController(4), shape)
    prompt = smollm2_tokenizer(CODE + CODE.replace("is_prime", "is_odd"))["input_ids"]
    assert len(prompt) > 2 * (window.window + window.sink)
    ar = generate_ids(target, [Request(list(prompt), 24)], set())[0]
    sp = generate_ids(target, [Request(list(prompt), 24)], set(), speculation=spec)[0]
    assert sp.token_ids == ar.token_ids
    assert sum(sp.round_stats.accepted_by_position) > 0
    assert made.cache.lengths[0] == 0 or made.cache.lengths[0] < 4 + 16 + window.slack + 8


def test_the_seeds_preset_runs_a_windowed_head_beside_the_full_one():
    from outrider.bench.methods import load_config, preset_path

    drafters = {m.spec.drafter for m in load_config(preset_path("seeds")).methods if m.spec}  # each checked
    assert {"eagle3:smollm2-135m-instruct", "eagle3:smollm2-135m-instruct,window=256,sink=4"} <= drafters
