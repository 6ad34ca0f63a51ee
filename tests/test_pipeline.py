"""Pipeline-sharded speculation (seed #8, outrider/cluster/pipeline*.py), in this process.

The stages are the same class a Ray actor holds, called directly ("local" transport): logits of a
scripted run of prefills, tree verifies, rejections and path commits are the bits of the whole
model's, with physical trim and with mask-based rewind; greedy text through `LLM` equals one
process's with no drafter, a draft model (chain and static tree) and the suffix drafter. The Ray
transport (actors, micro-batches, a stage that dies) is tests/test_pipeline_ray.py."""

from __future__ import annotations

import pytest
import torch

from tiny import add_tokenizer, make_tiny

from outrider.cluster.pipeline import local_pipeline, micro_groups, rows_of
from outrider.cluster.pipeline_llm import split_llm
from outrider.cluster.pipeline_rewind import MaskedRows
from outrider.cluster.pipeline_stage import stage_bounds
from outrider.errors import ConfigError
from outrider.llm import LLM
from outrider.models.batch import pack
from outrider.weights.loader import load_decoder, parse_dtype

PROMPTS = ["hello world", "abc def ghi", "zz"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipe")
    # projections of multiples of 32 inputs: at q4 every one is a native QuantLinear (the native layer runs)
    target = add_tokenizer(make_tiny("llama", root / "t", layers=5, intermediate_size=128))
    draft = add_tokenizer(make_tiny("llama", root / "d", layers=2, seed=3))
    return target, draft


def test_stage_bounds_cover_the_layers_in_order():
    assert stage_bounds(5, 2) == [(0, 3), (3, 5)]
    assert stage_bounds(30, 4) == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert micro_groups(5, 2) == [(0, 3), (3, 5)] and micro_groups(1, 4) == [(0, 1)]


def _script(model, state):
    """Prefill two slots (one in two chunks), then rounds of trees with rejections and a
    non-contiguous accepted path; every forward's logits."""
    g = torch.Generator().manual_seed(5)
    tok = lambda n: torch.randint(3, 90, (n,), generator=g)  # noqa: E731
    out = []
    for slot, chunks in ((0, [7, 5]), (1, [9])):
        for n in chunks:
            batch = pack([slot], [state.lengths[slot]], [tok(n)], logits="last", scratch_row=state.scratch_row)
            out.append(model.forward(batch, state).logits)
            state.set_length(slot, state.lengths[slot] + n)
    parents = torch.tensor([-1, 0, 0, 1, 1, 3])  # a tree of 6 nodes
    for step in range(6):
        lens = list(state.lengths)
        trees = [parents, torch.arange(-1, 3)]  # slot 0 a tree, slot 1 a chain of 4
        batch = pack([0, 1], lens, [tok(6), tok(4)], parents=trees, scratch_row=state.scratch_row)
        out.append(model.forward(batch, state).logits)
        path = [[0], [0, 1, 3, 5], [0, 2]][step % 3]  # rejected all, a path through 1 and 3, a side branch
        state.compact(0, [lens[0] + n for n in path], lens[0])
        state.set_length(0, lens[0] + len(path))
        state.set_length(1, lens[1] + [1, 4, 2][step % 3])
    return out


@pytest.mark.parametrize("stages", [2, 3])
def test_logits_are_the_whole_models_bits_with_trim_and_with_mask(folders, stages):
    """In the native layer (q4 here) both rewinds give the whole model's bits: its attention sums
    a query's weights by rank among the keys it sees, not by cache row, so masked rows between
    them change nothing (kernels/csrc/attention.c)."""
    whole = load_decoder(folders[0], torch.device("cpu"), parse_dtype("q4"))
    expected = _script(whole, whole.new_cache(2, 64))
    assert whole._native is not None  # the native layer ran the reference
    for rewind in ("trim", "mask"):
        pipe = local_pipeline(whole, stages, rewind=rewind)
        got = _script(pipe, pipe.new_cache(2, 64))
        assert len(got) == len(expected)
        for i, (a, b) in enumerate(zip(got, expected)):
            assert torch.equal(a, b), f"{rewind}: forward {i} differs by {(a - b).abs().max()}"


def test_torch_layers_trim_is_bits_and_mask_is_close(folders):
    """The torch layers (float32, SDPA) sum over every row read, masked ones included: trim gives
    the whole model's bits, mask rewind (more rows, with gaps) the same argmax within 1e-5."""
    whole = load_decoder(folders[0], torch.device("cpu"), None)
    expected = _script(whole, whole.new_cache(2, 64))
    assert whole._native is None
    trim = local_pipeline(whole, 2, rewind="trim")
    assert all(torch.equal(a, b) for a, b in zip(_script(trim, trim.new_cache(2, 64)), expected))
    mask = local_pipeline(whole, 2, rewind="mask")
    for a, b in zip(_script(mask, mask.new_cache(2, 64)), expected):
        assert torch.allclose(a, b, atol=1e-5, rtol=0) and torch.equal(a.argmax(-1), b.argmax(-1))


def test_mask_rewind_keeps_rejected_rows_where_they_were(folders):
    """Mask rewind never moves or cuts a row: a rejected round's rows stay, the next round
    writes past them, and only the map of positions changes."""
    whole = load_decoder(folders[0], torch.device("cpu"), parse_dtype("q4"))
    pipe = local_pipeline(whole, 2, rewind="mask")
    state = pipe.new_cache(2, 64)
    _script(pipe, state)
    rows = pipe.stages.stages[1].caches[state.cache_id]
    assert isinstance(rows, MaskedRows)
    pipe.forward(pack([0], [state.lengths[0]], [torch.tensor([4])], scratch_row=state.scratch_row), state)
    assert rows.lengths == state.lengths  # positions: the engine's
    assert rows.kv.lengths[0] > state.lengths[0] + 10  # physical rows: every row written stays
    assert rows.rows[0] != list(range(len(rows.rows[0])))  # positions map around the rejected rows
    assert rows.rows[0] == sorted(rows.rows[0])


@pytest.mark.parametrize("drafter,tree", [(None, "chain"), ("draft", "chain"), ("self", "static:2,2,1"),
                                          ("suffix", "chain")])
def test_greedy_text_equals_one_process(folders, drafter, tree):
    target, draft = folders
    name = {"draft": f"draft-model:{draft}", "self": f"draft-model:{target}"}.get(drafter, drafter)
    llm = LLM(str(target), drafter=name, tree=tree, device="cpu", threads=1, dtype="q4")
    expected = [c.token_ids for c in llm.generate(PROMPTS, 24)]  # one process
    whole, spec = llm.target, llm.speculator
    for rewind, stages in (("trim", 2), ("mask", 3)):
        llm.target, llm.speculator = whole, spec
        split_llm(llm, stages, transport="local", rewind=rewind)
        assert llm.target is not whole and (spec is None or llm.speculator is not spec)
        assert [c.token_ids for c in llm.generate(PROMPTS, 24)] == expected, (rewind, stages)
        if drafter == "self":  # the draft agrees: fewer traversals than tokens (one verifies several)
            assert llm.target.traversals < 3 * 24 // 2


def test_rows_of_splits_a_batch_without_changing_a_row(folders):
    """Micro-batches give each row the bits the whole batch gave it (the native layer computes a
    row alone; the torch layers' products may not: their micro-batches are not tested for bits)."""
    whole = load_decoder(folders[0], torch.device("cpu"), parse_dtype("q4"))
    state = whole.new_cache(3, 64)
    for slot in range(3):
        whole.forward(pack([slot], [0], [torch.arange(3, 3 + 4 + slot)], logits="none"), state)
        state.set_length(slot, 4 + slot)
    batch = pack([2, 0, 1], [6, 4, 5], [torch.tensor([5, 6]), torch.tensor([7]), torch.tensor([8, 9])],
                 logits="real", scratch_row=state.scratch_row)
    both = whole.forward(batch, state).logits
    parts = torch.cat([whole.forward(rows_of(batch, lo, hi), state).logits for lo, hi in [(0, 1), (1, 3)]])
    assert torch.equal(both, parts)


def test_refusals_are_one_line(folders):
    target, _ = folders
    llm = LLM(str(target), device="cpu", threads=1)
    with pytest.raises(ConfigError, match="only 5 layers"):
        split_llm(llm, 6, transport="local")
    with pytest.raises(ConfigError, match="hop-ms"):
        split_llm(llm, 2, transport="local", hop_ms=-1)
    with pytest.raises(ConfigError, match="rewind"):
        split_llm(llm, 2, transport="local", rewind="cut")
    with pytest.raises(ConfigError, match="ray transport"):
        split_llm(llm, 2, transport="local", micro_batches=2)
    early = LLM(str(target), drafter="early-exit:1", device="cpu", threads=1)
    with pytest.raises(ConfigError, match="live on the pipeline's stages"):
        split_llm(early, 2, transport="local")


def test_a_prompt_past_the_native_workspace_is_filled_in_parts_on_every_stage(folders, monkeypatch, runtime):
    """A prompt the whole model fills in parts of the native layer (models/decoder.py) is filled in
    the same parts on each stage, the rows joined again between stages: the same bits."""
    import outrider.models.decoder as decoder_module

    runtime(gemm_prefill="off")  # prefills in the native layer's fill kernel, where parts apply
    whole = load_decoder(folders[0], torch.device("cpu"), parse_dtype("q4"))
    prompt = torch.arange(3, 23)  # 20 tokens, in parts of 6
    monkeypatch.setattr(decoder_module, "NATIVE_FILL_FLOATS", whole._fill_rows_floats(6, 20))

    def run(model):
        state = model.new_cache(1, 64)
        model.forward(pack([0], [0], [prompt], logits="none", scratch_row=state.scratch_row), state)
        state.set_length(0, 20)
        return model.forward(pack([0], [20], [torch.tensor([7])], scratch_row=state.scratch_row), state).logits

    expected = run(whole)
    assert whole._fill_part_rows(pack([0], [0], [prompt], logits="none")) == 6  # the parts path was taken
    for rewind in ("trim", "mask"):
        assert torch.equal(run(local_pipeline(whole, 2, rewind=rewind)), expected), rewind


def test_mask_rewind_sends_padding_to_the_physical_scratch_row():
    """The engine's scratch row (its max_len) is an ordinary row of the stage's longer physical
    cache: padding must go to the physical scratch row, gaps or no gaps."""
    from outrider.models.kv_cache import KVCache

    rows = MaskedRows(KVCache(1, 2, 16, 1, 4, torch.float32, "cpu"), 8)
    assert rows.kv.scratch_row == 16 and rows.scratch_row == 8
    batch = pack([0, 1], [0, 0], [torch.tensor([3, 4, 5]), torch.tensor([6])], scratch_row=rows.scratch_row)
    assert batch.rows[1].tolist() == [0, 8, 8]  # the engine's padding
    assert rows.physical(batch).rows[1].tolist() == [0, 16, 16]
    rows.set_length(0, 1)  # a rejection: a gap from now on
    rows.set_length(1, 1)
    batch = pack([0, 1], [1, 1], [torch.tensor([7, 8]), torch.tensor([9])], scratch_row=rows.scratch_row)
    assert rows.physical(batch).rows.tolist() == [[3, 4], [1, 16]]
