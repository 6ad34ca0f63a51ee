"""Native weights in 2 MB pages (models/native/pages.py): the same bytes, 2 MB-aligned, in a
mapping Linux may serve with huge pages; a model placed so computes bit-identical logits."""

import pytest
import torch

from outrider.models import native
from outrider.models.batch import pack
from outrider.models.loader import load_decoder
from outrider.models.native import pages


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.float16, torch.float32])
def test_huge_copy_keeps_the_bytes(dtype):
    t = (torch.randn(1500, 1000) * 50).to(dtype)  # >= 2 MB for every dtype but int8/uint8 at 1.5 MB
    t = torch.cat([t] * 2)  # [3000, 1000]: 3 MB at one byte a value
    copy = pages.huge_copy(t)
    assert copy.dtype == t.dtype and copy.shape == t.shape and torch.equal(copy, t)
    assert copy.data_ptr() != t.data_ptr() and copy.data_ptr() % pages.HUGE == 0
    copy[0, 0] = 1  # its own writable memory
    assert t[0, 0] != copy[0, 0] or t[0, 0] == 1


def test_small_or_strided_tensors_stay():
    small = torch.zeros(1000, dtype=torch.uint8)
    assert pages.huge_copy(small) is small
    strided = torch.zeros(4000, 1000)[:, ::2]
    assert pages.huge_copy(strided) is strided


@pytest.mark.skipif(not pages.available(), reason="no transparent huge pages here (Linux, THP madvise/always)")
def test_the_mapping_may_take_huge_pages():
    """The kernel marks the copy's mapping eligible for huge pages (whether it grants them depends
    on free memory: not asserted)."""
    copy = pages.huge_copy(torch.ones(4 << 20, dtype=torch.uint8))
    address = copy.data_ptr()
    lines = open("/proc/self/smaps").read().splitlines()
    for i, line in enumerate(lines):
        span = line.split()[0]
        if "-" in span and all(c in "0123456789abcdef-" for c in span):
            start, end = (int(x, 16) for x in span.split("-"))
            if start <= address < end:
                flags = {ln.split(":")[0]: ln.split(":")[1].strip() for ln in lines[i + 1:i + 30] if ":" in ln}
                assert flags.get("THPeligible") == "1"
                return
    pytest.fail("the copy's mapping is not in /proc/self/smaps")


@pytest.mark.model
@pytest.mark.skipif(not native.available(), reason=native.reason())
def test_placed_model_gives_the_same_logits(smollm2_path, monkeypatch):
    monkeypatch.setenv("OUTRIDER_HUGE_PAGES", "0")
    plain = load_decoder(smollm2_path, "cpu", "q4")
    monkeypatch.setenv("OUTRIDER_HUGE_PAGES", "1")
    placed = load_decoder(smollm2_path, "cpu", "q4")
    head = placed.lm_head.state["weight"]
    if pages.available():  # the 30 MB Q8_0 head moved; the tied embedding follows its codes
        assert head.q.data_ptr() % pages.HUGE == 0
        assert placed.embed.q.data_ptr() == head.q.data_ptr()
    assert torch.equal(head.q, plain.lm_head.state["weight"].q)
    logits = []
    for model in (plain, placed):
        cache = model.new_cache(1, 64)
        batch = pack([0], [0], [torch.tensor([1, 502, 3300, 17, 9])], logits="all", scratch_row=cache.scratch_row)
        logits.append(model.forward(batch, cache).logits)
    assert torch.equal(logits[0], logits[1])
