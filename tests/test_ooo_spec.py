"""OoO-Spec (drafters/ooo.py): a sidecar model's hint, computed in the background, as a draft source.

- The hint's tokens are proposed once it is published, matched on the committed tokens (the
  prompt's tail before any output), merged with the suffix tree; before, the plain suffix drafter.
- Greedy speculative output equals autoregressive output on tiny models: the hint ready before
  the first round, arriving mid-decode (held back by an injected delay until round 3), and never
  arriving; with the target as its own sidecar (a right hint) and another model (a wrong one).
- Bad options (no sidecar, a sidecar that is not there, another tokenizer, a bad length) are
  refused in one line before anything loads.
"""

import shutil
import threading

import pytest
from enumerate_law import one_thread
from tiny import add_tokenizer

from outrider.drafters.ooo import Hint, OooDrafter, parse_argument
from outrider.drafters.registry import parse_drafter
from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.errors import ConfigError
from outrider.spec.types import Budget, VerifyResult
from outrider.weights.loader import load_decoder


class FixedSidecar(OooDrafter):
    """A drafter whose 'sidecar' answers a fixed hint (the unit tests need no model)."""

    def __init__(self, hint, **kw):
        super().__init__(sidecar=None, **kw)
        self.fixed = hint

    def predict(self, hint):
        return list(self.fixed)


def test_the_hint_is_proposed_once_ready():
    gate = threading.Event()
    d = FixedSidecar([40, 41, 42, 43, 44], delay=lambda hint: gate.wait(5))
    prompt = [3, 4, 5, 9]
    d.start(0, prompt)
    assert d.propose(0, prompt, Budget(4, 8)).size == 1  # not ready: the suffix drafter, nothing to match
    gate.set()
    d._queue.join()
    tree = d.propose(0, prompt, Budget(4, 8))
    assert tree.tokens.tolist() == [9, 40, 41, 42, 43]  # the hint from its start: the prompt's tail matched
    assert tree.parents.tolist() == [-1, 0, 1, 2, 3]
    d.update(0, VerifyResult(accepted_nodes=[1, 2], tokens=[40, 41, 7]))
    # 7 is not in the hint: the longest match is none; a later 42 re-syncs at its place in the hint
    assert d.propose(0, prompt + [40, 41, 7], Budget(4, 8)).size == 1
    assert d.propose(0, prompt + [40, 41, 7, 42], Budget(2, 8)).tokens.tolist() == [42, 43, 44]
    stats = d.stats()
    assert stats["hint_accepted"] == 2 and stats["hints_ready"] == 1 and stats["hint_latency_s"][0] > 0
    d.finish(0, prompt + [40, 41, 7, 42])
    assert d.stats()["requests_helped"] == 1


def test_the_hint_merges_with_the_suffix_tree_under_the_budget():
    prompt = [5, 6, 7, 5, 6, 7, 5]  # the suffix tree drafts 6 7 5 (each share 1.0)
    d = FixedSidecar([6, 8, 9], wait=True)  # the hint: 6 8 9 (each 1.0)
    d.start(0, prompt)
    assert tree_paths(d.propose(0, prompt, Budget(3, 5))) == {(6,), (6, 7), (6, 7, 5), (6, 8), (6, 8, 9)}
    # one node short: ties go to the suffix tree, then to shallower paths
    assert tree_paths(d.propose(0, prompt, Budget(3, 4))) == {(6,), (6, 7), (6, 7, 5), (6, 8)}


def tree_paths(tree) -> set:
    out = set()
    for i in range(1, tree.size):
        path, j = [], i
        while j > 0:
            path.append(int(tree.tokens[j]))
            j = int(tree.parents[j])
        out.add(tuple(reversed(path)))
    return out


def test_a_finished_request_drops_its_hint():
    gate = threading.Event()
    d = FixedSidecar([1, 2], delay=lambda hint: gate.wait(5))
    d.start(0, [3, 4])
    d.finish(0, [3, 4, 5])
    gate.set()
    d._queue.join()
    assert d._hints == {} and d.stats()["hints_ready"] == 0 and d.stats()["hints_late"] == 1


def test_close_cancels_the_hints_and_ends_the_worker():
    """What runs at exit: the worker thread ends (after the forward it is in) instead of being
    killed inside it with the interpreter."""
    gate = threading.Event()
    d = FixedSidecar([1, 2], delay=lambda hint: gate.wait(5))
    d.start(0, [3, 4])
    d.start(1, [5, 6])  # queued behind the first
    gate.set()
    d.close()
    assert not d._worker.is_alive() and all(h.cancelled for h in d._hints.values())


@pytest.mark.parametrize("text, why", [
    ("ooo", "needs a sidecar model"), ("ooo:", "needs a sidecar model"),
    ("ooo:smollm2-135m-instruct,tokens=0", "tokens='0'"), ("ooo:x,tokens=ten", "tokens='ten'"),
])
def test_bad_options_are_refused_in_one_line(text, why):
    with pytest.raises(ConfigError) as err:
        SpecOptions(text).check()
    assert str(err.value).startswith(f"--drafter '{text}': ") and why in str(err.value)
    assert "\n" not in str(err.value)


def test_options_parse():
    assert parse_argument("smollm2-135m-instruct") == parse_drafter("ooo:smollm2-135m-instruct")[1]
    assert parse_argument("a,tokens=32").tokens == 32 and parse_argument("a").tokens == 64


# -- on a target ------------------------------------------------------------------------------------
PROMPTS = [[3, 4, 5, 3, 4, 5, 3], [6, 7, 3, 6, 7, 3, 6], [5], [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4]]


@pytest.fixture(scope="module")
def llama(tiny_folders):
    return tiny_folders["llama"], load_decoder(tiny_folders["llama"], "cpu")


def refuse(target, folder, option):
    with pytest.raises(ConfigError) as err:
        Speculator.build(SpecOptions(option, "chain", "fixed:4"), target, folder)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_a_missing_sidecar_or_another_tokenizer_is_refused_before_loading(llama, tiny_folders, tmp_path,
                                                                           monkeypatch):
    folder, target = llama
    import outrider.weights.loader as loader

    monkeypatch.setattr(loader, "load_decoder", lambda *a, **k: pytest.fail("loaded a model"))
    for missing in (tmp_path / "nowhere", "no-such-model"):
        message = refuse(target, folder, f"ooo:{missing}")
        assert f"does not fit this target: the sidecar: unknown model '{missing}'" in message
    other = tmp_path / "other"
    shutil.copytree(tiny_folders["llama-draft"], other)
    add_tokenizer(other, vocab=80)
    message = refuse(target, folder, f"ooo:{other}")
    assert "does not fit this target: the sidecar: its tokenizer differs" in message


def generate(target, spec, prompts, n=24):
    with one_thread():
        return [f.token_ids for f in generate_ids(target, [Request(list(p), n) for p in prompts], set(),
                                                  speculation=spec)]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_output_is_autoregressive_with_the_hint_ready(tiny_folders, family):
    folder = tiny_folders[family]
    target = load_decoder(folder, "cpu")
    plain = generate(target, None, PROMPTS)
    spec = Speculator.build(SpecOptions(f"ooo:{folder}", "chain", "fixed:4"), target, folder)
    assert spec.drafter.sidecar is not target  # its own object, for its own thread
    spec.drafter.wait = True
    assert generate(target, spec, PROMPTS) == plain
    stats = spec.drafter.stats()
    assert stats["hints_ready"] == len(PROMPTS) and stats["hint_accepted"] > 0  # the target's own greedy hint


def test_greedy_output_is_autoregressive_with_the_hint_mid_decode_or_never(llama, tiny_folders):
    folder, target = llama
    plain = generate(target, None, PROMPTS)
    for sidecar in (folder, tiny_folders["llama-draft"]):  # a right hint, then a wrong one
        spec = Speculator.build(SpecOptions(f"ooo:{sidecar},tokens=16", "chain", "fixed:4"), target, folder)
        drafter = spec.drafter
        gate = threading.Event()
        drafter.delay = lambda hint: gate.wait(10)
        rounds = []
        update = drafter.update

        def counted(seq_id, result, hidden=None):
            update(seq_id, result, hidden)
            rounds.append(seq_id)
            if len(rounds) == 3:  # the hints arrive now, in the middle of the decode
                gate.set()
                drafter._queue.join()

        drafter.update = counted
        assert generate(target, spec, PROMPTS) == plain
        assert len(rounds) > 3 and drafter.stats()["hints_ready"] == len(PROMPTS)
        if sidecar == folder:
            assert drafter.stats()["hint_accepted"] > 0
    never = Speculator.build(SpecOptions(f"ooo:{folder}", "chain", "fixed:4"), target, folder)
    stuck = threading.Event()
    never.drafter.delay = lambda hint: stuck.wait(10)
    assert generate(target, never, PROMPTS) == plain  # the target never waits for a hint
    assert never.drafter.stats()["hints_ready"] == 0
    stuck.set()


def test_seeded_sampling_equals_plain_sampling(llama):
    from outrider.sampling import SamplingParams

    folder, target = llama
    params = SamplingParams(temperature=0.8, seed=17)
    spec = Speculator.build(SpecOptions(f"ooo:{folder}", "chain", "fixed:4"), target, folder)
    spec.drafter.wait = True
    with one_thread():
        plain = [f.token_ids for f in generate_ids(target, [Request(list(p), 20, params) for p in PROMPTS], set())]
        ours = [f.token_ids for f in generate_ids(target, [Request(list(p), 20, params) for p in PROMPTS], set(),
                                                 speculation=spec)]
    assert ours == plain


def test_the_hint_is_the_sidecars_greedy_decode(llama):
    folder, target = llama
    spec = Speculator.build(SpecOptions(f"ooo:{folder},tokens=10", "chain", "fixed:4"), target, folder)
    prompt = PROMPTS[3]
    spec.drafter.stop_ids = frozenset()  # the plain run below stops at nothing either
    with one_thread():
        (ar,) = [f.token_ids for f in generate_ids(target, [Request(list(prompt), 10)], set())]
        got = spec.drafter.predict(Hint(list(prompt), 0.0))
    assert got == ar
