"""Torch's thread count follows the cores other processes leave free (outrider/engine/threads.py):
the rule, CpuShare on a simulated machine, /proc/stat, when it stays off, and the hook in
`LLM.generate`. No timing here: the speed it buys is measured by scripts/bench_shared_cpu.py."""

import sys

import pytest
import torch

from outrider import LLM
from outrider.engine.threads import CpuShare, FixedThreads, cpu_share_for, cpu_ticks

HZ = 100  # clock ticks per second in the simulated /proc/stat


class Machine:
    """A simulated machine: a clock, our CPU seconds, and /proc/stat's busy and total ticks."""

    def __init__(self, cores: int = 2):
        self.cores, self.now, self.own, self.busy, self.total = cores, 0.0, 0.0, 0, 0

    def run(self, seconds: float, ours: float, others: float) -> None:
        """`seconds` pass with `ours` of our cores and `others` of other processes' busy."""
        self.now += seconds
        self.own += ours * seconds
        self.busy += round(HZ * (ours + others) * seconds)
        self.total += round(HZ * self.cores * seconds)

    def share(self, **kw) -> CpuShare:
        share = CpuShare(ticks=lambda: (self.busy, self.total), own_cpu=lambda: self.own, clock=lambda: self.now, **kw)
        share.cores = self.cores
        return share


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("threads, others, expected", [
    (2, 0.0, 2), (2, 0.45, 2),  # a light neighbour: keep both
    (2, 0.55, 1), (2, 1.0, 1), (2, 3.0, 1),  # one core taken (or more): one thread
    (1, 0.4, 1), (1, 0.2, 2),  # back up only once the core is three-quarters free
])
def test_threads_wanted_on_two_cores(threads, others, expected):
    assert CpuShare.wanted(threads, ceiling=2, cores=2, others=others) == expected


def test_never_above_the_count_the_call_began_with():
    assert CpuShare.wanted(1, ceiling=1, cores=8, others=0.0) == 1
    assert CpuShare.wanted(4, ceiling=4, cores=8, others=5.0) == 3


def test_a_busy_neighbour_takes_a_thread_and_gives_it_back(two_threads):
    m = Machine()
    share = m.share(period_s=0.5, memory_s=5.0)
    share.begin()
    m.run(0.6, ours=2.0, others=0.0)
    share.tick()
    assert torch.get_num_threads() == 2 and share.others == pytest.approx(0.0, abs=0.05)
    m.run(0.6, ours=1.2, others=0.8)  # a neighbour gets 0.8 of a core beside our spinning threads
    share.tick()
    assert torch.get_num_threads() == 1 and share.others == pytest.approx(0.8, abs=0.05)
    m.run(0.2, ours=1.0, others=0.0)
    share.tick()  # within the period: no new reading
    assert torch.get_num_threads() == 1
    share.end()
    assert torch.get_num_threads() == 2, "end() puts back the count the call began with"
    share.begin()
    assert torch.get_num_threads() == 1, "a recent choice carries into the next call"
    m.run(0.6, ours=1.0, others=0.05)  # the neighbour left
    share.tick()
    assert torch.get_num_threads() == 2
    share.end()


def test_an_old_choice_is_forgotten(two_threads):
    m = Machine()
    share = m.share(period_s=0.5, memory_s=5.0)
    share.begin()
    m.run(1.0, ours=1.0, others=1.0)
    share.tick()
    share.end()
    assert share.threads == 1
    m.run(10.0, ours=0.0, others=0.0)
    share.begin()
    assert torch.get_num_threads() == 2
    share.end()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/stat is Linux's")
def test_proc_stat_ticks_grow():
    busy0, total0 = cpu_ticks()
    sum(range(3_000_000))
    busy1, total1 = cpu_ticks()
    assert 0 <= busy0 <= total0 and busy1 > busy0 and total1 > total0
    assert cpu_ticks(frozenset({10**6})) is None  # no such core


def test_off_when_the_user_chose_a_count(monkeypatch):
    assert isinstance(cpu_share_for(2), FixedThreads)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert isinstance(cpu_share_for(None), FixedThreads)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/stat is Linux's")
def test_on_by_default_on_linux(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert isinstance(cpu_share_for(None), CpuShare)


def test_generate_follows_the_free_cores_and_restores_the_count(tiny_folders, two_threads):
    """LLM.generate drives CpuShare once per round: a neighbour on one of two cores gives one
    thread while it decodes, and the caller's count is back afterwards."""
    llm = LLM(str(tiny_folders["llama"]))
    m = Machine()
    share = llm.cpu_share = m.share(period_s=0.5)
    seen = []  # torch's thread count after each round's tick
    real_tick = share.tick

    def tick():
        m.run(1.0, ours=1.0, others=1.0)  # each round "takes" a second beside a busy neighbour
        real_tick()
        seen.append(torch.get_num_threads())

    share.tick = tick
    llm.generate("hello there", max_new_tokens=12)
    assert len(seen) >= 2 and set(seen) == {1}, seen
    assert torch.get_num_threads() == 2


def test_generate_keeps_a_count_the_user_chose(tiny_folders, two_threads):
    llm = LLM(str(tiny_folders["llama"]), threads=2)
    assert isinstance(llm.cpu_share, FixedThreads)
