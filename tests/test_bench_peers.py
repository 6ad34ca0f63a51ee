"""Peers run in child processes of their own (bench/peer_process.py): a peer that segfaults, exits,
raises or hangs is one failed row with its reason, and the rest of the bench goes on. The
llama.cpp peer loads with its extra buffer types off on a CPU with AMX tiles (without llama.cpp
installed: a stand-in `llama_cpp` module shaped as llama-cpp-python 0.3.36's)."""

import importlib.machinery
import json
import os
import signal
import sys
import time
import types
from pathlib import Path

import pytest

from outrider.bench import peer_process, peers
from outrider.bench import run as bench_run
from outrider.bench.peer_process import PeerFailed, PeerProcess, PeerUnavailable
from outrider.bench.runner import PromptRun
from outrider.cli import main

FIXTURES = Path(__file__).parent / "fixtures"


# -- stand-in peers: built in the child, which imports this module by name --------------------------

class Misbehaving:
    """Answers `good` completions, then misbehaves as `how` says."""

    def __init__(self, how: str, good: int = 0):
        self.how, self.good = how, good
        # what a peer says of its settings (llama.cpp: buffers off on AMX); a steady one says nothing
        self.note = None if how == "steady" else f"misbehaves: {how}"
        if how == "abort-on-load":
            os.abort()
        if how == "unavailable":
            raise PeerUnavailable("not on this machine")

    def run(self, prompt_ids, max_new_tokens):
        if self.good > 0:
            self.good -= 1
            return PromptRun([7] * max_new_tokens, 0.01, {"new_tokens": max_new_tokens})
        if self.how == "segv":
            os.kill(os.getpid(), signal.SIGSEGV)
        if self.how == "exit":
            os._exit(3)
        if self.how == "raise":
            raise RuntimeError("llama_decode returned -1")
        if self.how == "hang":
            time.sleep(3600)
        return PromptRun(list(prompt_ids[:2]), 0.01, {"new_tokens": 2})


def misbehaving(how: str, good: int = 0, **_):
    return Misbehaving(how, good)


# Each way of dying costs a spawned child (a fresh interpreter importing torch), so each is checked
# once: a segfault in a completion and an abort while loading in the whole bench below (the same
# PeerProcess paths, their reasons compared whole there); exiting, raising and hanging here.
@pytest.mark.parametrize("how,expect", [
    ("exit", "its process exited with status 3"),
    ("raise", "raised RuntimeError: llama_decode returned -1"),
    ("hang", "no answer in 2 s for a completion; stopped it"),
])
def test_a_peer_that_dies_in_a_completion_says_how(monkeypatch, how, expect):
    monkeypatch.setattr(peer_process, "RUN_TIMEOUT_S", 2.0)
    peer = PeerProcess(misbehaving, {"how": how, "good": 1}, threads=1)
    assert peer.run([5, 6, 7], 3).output_ids == [7, 7, 7]  # the first answer comes back whole
    with pytest.raises(PeerFailed) as err:
        peer.run([5, 6, 7], 3)
    assert str(err.value) == expect
    peer.close()
    assert not peer._proc.is_alive()


def test_a_peer_that_cannot_run_says_why_while_loading():
    """(A peer that dies while loading: the whole bench below, its "aborts" method.)"""
    with pytest.raises(PeerUnavailable, match="^not on this machine$"):
        PeerProcess(misbehaving, {"how": "unavailable"}, threads=1)


# -- the whole bench: one peer segfaults in its second completion, one aborts while loading -------

def methods_file(tmp_path: Path, model: Path) -> Path:
    path = tmp_path / "methods.toml"
    path.write_text(f"""
models = ["{model}"]
workloads = ["jsonl:{FIXTURES / 'prompts.jsonl'}"]
max_new_tokens = 6

[[method]]
name = "ngram"
drafter = "ngram"

[[method]]
name = "crashes"
peer = "transformers-prompt-lookup"

[[method]]
name = "aborts"
peer = "llama.cpp"

[[method]]
name = "steady"
peer = "transformers"
""")
    return path


# a stand-in peer for each kind the methods file names (each in a child process, as make_peer starts them)
STAND_INS = {"transformers-prompt-lookup": {"how": "segv", "good": 1},  # "crashes": its second completion
             "llama.cpp": {"how": "abort-on-load"},  # "aborts"
             "transformers": {"how": "steady", "good": 1000}}  # "steady": answers every completion


def test_peers_that_crash_are_one_failed_row_each(tiny_folders, tmp_path, capsys, monkeypatch):
    """One run, two crashes at the two places a peer can die (in a completion, while loading):
    each is a FAILED row with its reason, and ours and the steady peer run every prompt."""
    monkeypatch.setattr(bench_run, "make_peer", lambda kind, model_path, **kw: PeerProcess(
        misbehaving, STAND_INS[kind], threads=1))
    model = tiny_folders["llama"]
    out = tmp_path / "out"
    code = main(["bench", "--methods", str(methods_file(tmp_path, model)), "--out", str(out),
                 "--threads", "1", "--no-progress"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    results = json.loads((out / "results.json").read_text())
    ran = {(r["method"], len(r["prompts"])) for r in results["runs"]}
    assert ran == {("autoregressive", 3), ("ngram", 3), ("steady", 3)}  # the others' results, whole
    assert results["audit"]["ok"]
    workload = results["runs"][0]["workload"]
    reasons = {
        # in its second completion: the first came back whole
        "crashes": f"crashed: its process was killed by SIGSEGV (on {workload} prompt prime)",
        "aborts": "crashed: its process was killed by SIGABRT",
    }
    assert {s["method"]: (s["failed"], s["reason"]) for s in results["skipped"]} == {
        name: (True, reason) for name, reason in reasons.items()}
    report = (out / "report.md").read_text()
    rows = {line.split()[0]: line for line in captured.out.splitlines() if " (peer" in line}
    assert {rows[name].split()[-1] for name in reasons} == {"FAILED"} and "FAILED" not in rows["steady"]
    for name, reason in reasons.items():
        assert f"peer {name} failed on {model}: {reason}; the bench goes on without it" in captured.err
        assert f"FAILED: peer {name}: {reason}" in captured.out
        assert f"FAILED: {name} on {model}: {reason}" in report
    # the segfaulting peer loaded, so it said what it runs with; the one that aborted never did
    assert results["peer_notes"] == [{"model": str(model), "method": "crashes", "note": "misbehaves: segv"}]
    assert "Peer settings" in report and "misbehaves: segv" in report and "abort-on-load" not in report


def test_failed_and_skipped_peers_are_kept_apart_in_the_store(tmp_path):
    from outrider.bench.store import RunStore

    store = RunStore.open(tmp_path, {"a": 1})
    store.add_skipped("m", "llama.cpp", "not installed")
    store.add_skipped("m", "crashes", "crashed: SIGSEGV", failed=True)
    store.add_note("m", "llama.cpp", "extra buffer types off")
    again = RunStore.open(tmp_path, {"a": 1}, resume=True)
    assert again.skipped == [{"model": "m", "method": "llama.cpp", "reason": "not installed"},
                             {"model": "m", "method": "crashes", "reason": "crashed: SIGSEGV", "failed": True}]
    assert again.skipped_on("m") == {"llama.cpp": "not installed", "crashes": "crashed: SIGSEGV"}
    assert again.notes_on("m") == {"llama.cpp": "extra buffer types off"}


# -- llama.cpp: its extra buffer types off where they crashed ---------------------------------------

@pytest.fixture
def fake_llama_cpp(monkeypatch):
    """`llama_cpp` as llama-cpp-python 0.3.36 is shaped: Llama() reads its model parameters from
    llama_cpp.llama_cpp.llama_model_default_params() and swallows unknown keyword arguments."""
    native = types.ModuleType("llama_cpp.llama_cpp")

    class Params:
        def __init__(self):
            self.use_extra_bufts = True
            self.n_gpu_layers = 0

    native.llama_model_default_params = Params
    package = types.ModuleType("llama_cpp")
    package.__spec__ = importlib.machinery.ModuleSpec("llama_cpp", None, is_package=True)
    package.llama_cpp = native

    class Llama:
        def __init__(self, model_path, *, n_ctx=512, n_threads=None, verbose=True, draft_model=None,
                     logits_all=False, **kwargs):
            self.model_params = native.llama_model_default_params()
            self.ignored = kwargs

    package.Llama = Llama
    monkeypatch.setitem(sys.modules, "llama_cpp", package)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_cpp", native)
    return package


@pytest.mark.parametrize("flags,extra", [({"avx512f", "amx_tile", "amx_bf16"}, False), ({"avx2", "fma"}, True)])
def test_llama_cpp_loads_without_extra_buffer_types_on_amx(fake_llama_cpp, tmp_path, monkeypatch, flags, extra):
    import outrider.config

    monkeypatch.setattr(outrider.config, "cpu_flags", lambda: frozenset(flags))
    gguf = tmp_path / "original.gguf"
    gguf.write_bytes(b"GGUF")
    peer = peers.open_peer("llama.cpp", tmp_path, None, 10, 1)
    assert peer.llm.model_params.use_extra_bufts is extra
    assert peer.llm.ignored == {}  # no argument Llama() would swallow and ignore
    assert fake_llama_cpp.llama_cpp.llama_model_default_params().use_extra_bufts  # put back after loading
    if extra:
        assert peer.note is None
    else:
        assert "extra buffer types off" in peer.note and "AMX" in peer.note


def test_llama_cpp_with_an_argument_for_it_gets_the_argument(fake_llama_cpp, tmp_path):
    class Newer(fake_llama_cpp.Llama):
        def __init__(self, model_path, *, use_extra_bufts=True, **kwargs):
            super().__init__(model_path, **kwargs)
            self.model_params.use_extra_bufts = use_extra_bufts

    fake_llama_cpp.Llama = Newer
    (tmp_path / "original.gguf").write_bytes(b"GGUF")
    peer = peers.LlamaCppPeer(tmp_path / "original.gguf", "llama.cpp", threads=1, amx=True)
    assert peer.llm.model_params.use_extra_bufts is False


def test_llama_cpp_not_installed_is_skipped_before_a_process_starts(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import and find_spec fail as when not installed
    monkeypatch.setattr(peers, "PeerProcess", lambda *a, **k: pytest.fail("started a process"))
    with pytest.raises(PeerUnavailable, match="llama-cpp-python is not installed"):
        peers.make_peer("llama.cpp", tmp_path, assistant_path=None, lookup=10, threads=1)
