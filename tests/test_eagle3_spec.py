"""EAGLE-3 drafting end to end (issue 9, item 2) on a tiny random target with a tiny random head:
greedy speculative output equals autoregressive output for chain, static and dynamic trees (and
the head's drafts are accepted sometimes); sampled chains use rejection sampling and reproduce
per seed; sampled trees (tree walk) equal plain sampling; the hidden states the drafter gets
(prefill, chunked prefill, then the accepted path of every round) are the target's own at those
positions, and the greedy output does not depend on the prefill chunking."""

import math

import pytest
import torch
from eagle3_tiny import target_with_head
from enumerate_law import one_thread

from outrider.control.controllers import FixedController
from outrider.drafters.base import DrafterBase
from outrider.drafters.capabilities import Capabilities, Drafts
from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.kernels import native
from outrider.models.batch import pack
from outrider.weights.loader import load_decoder
from outrider.sampling import SamplingParams
from outrider.engine.loop import EngineLoop
from outrider.spec.shapes import parse_shape
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.spec.types import Budget, DraftTree
from outrider.spec.verifiers import VERIFIERS

PROMPTS = [[3, 4, 5, 3, 4, 5, 3], [6, 7, 3, 6, 7, 3, 6], [5], [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4]]


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A vocab-8 target (so random drafts are sometimes right) and a head with 6 draft tokens."""
    folder, head = target_with_head(tmp_path_factory.mktemp("e3spec"))
    return folder, load_decoder(folder, "cpu"), head


def run(target, spec, params=SamplingParams(), n=16, **engine):
    requests = [Request(list(p), n, params) for p in PROMPTS]
    if not engine:
        return generate_ids(target, requests, set(), speculation=spec)
    return EngineLoop(target, set(), spec, **engine).run_all(requests)


def outputs(finished):
    return [f.token_ids for f in finished]


@pytest.mark.parametrize("tree", ["chain", "static:2,2,1", "dynamic:3,8"])
def test_greedy_equals_autoregressive_and_drafts_are_accepted(setup, tree):
    folder, target, head = setup
    spec = Speculator.build(SpecOptions(f"eagle3:{head}", tree, "fixed:3"), target, folder)
    assert spec.hidden_layers == (1, 2, 3)  # sglang ids 0, 1, 2 = the outputs of layers 0, 1, 2
    assert spec.verifier_for(SamplingParams()) is VERIFIERS["greedy_chain" if tree == "chain" else "greedy_tree"].verify
    fast = run(target, spec)
    assert outputs(fast) == outputs(run(target, None))
    assert sum(f.round_stats.committed for f in fast) > sum(f.round_stats.rounds for f in fast)  # some drafts accepted
    # chunked prefill (3 prompt tokens a step, requests joining while others decode): the same
    assert outputs(run(target, spec, max_running=2, chunk_size=3)) == outputs(fast)


def test_sampled_chain_is_rejection_sampling_reproducible_per_seed(setup):
    folder, target, head = setup
    spec = Speculator.build(SpecOptions(f"eagle3:{head}", "chain", "fixed:3"), target, folder)
    assert spec.verifier_for(SamplingParams(temperature=1.0, seed=1)) is VERIFIERS["rejection_chain"].verify
    a = outputs(run(target, spec, SamplingParams(temperature=1.0, seed=1)))
    assert a == outputs(run(target, spec, SamplingParams(temperature=1.0, seed=1)))
    assert a == outputs(run(target, spec, SamplingParams(temperature=1.0, seed=1), max_running=2, chunk_size=3))
    assert a != outputs(run(target, spec, SamplingParams(temperature=1.0, seed=2)))


def test_sampled_trees_equal_plain_sampling(setup):
    folder, target, head = setup
    spec = Speculator.build(SpecOptions(f"eagle3:{head}", "dynamic:2,6", "fixed:3"), target, folder)
    params = SamplingParams(temperature=1.0, seed=5)
    assert spec.verifier_for(params) is VERIFIERS["tree_walk"].verify
    assert outputs(run(target, spec, params)) == outputs(run(target, None, params))


# -- the wiring: what a drafter that declares needs_hidden receives -------------------------------
class Recorder(DrafterBase):
    """Drafts a chain from a known output (one wrong token every other round) and records the
    hidden states it is given."""

    capabilities = Capabilities(trees={"chain": Drafts("chain")}, needs_hidden=(3, 1))
    name = "recorder"

    def __init__(self, answers: dict[int, list[int]]):
        self.answers, self.seen, self.rounds = answers, {}, 0

    def max_nodes(self, depth):
        return depth

    def start(self, seq_id, prompt, params=None, hidden=None):
        assert (hidden is None) == (len(prompt) == 1)
        self.seen[seq_id] = [] if hidden is None else [hidden]

    def propose(self, seq_id, tokens, budget):
        self.rounds += 1
        drafts = self.answers[seq_id][len(tokens): len(tokens) + budget.depth]
        if self.rounds % 2 and len(drafts) > 1:
            drafts[1] = (drafts[1] + 1) % 8
        return DraftTree.chain(tokens[-1], drafts)

    def update(self, seq_id, result, hidden=None):
        assert hidden.shape[0] == 1 + result.num_accepted
        self.seen[seq_id].append(hidden)

    def finish(self, seq_id, tokens):
        pass


@pytest.mark.parametrize("engine", [{}, dict(max_running=2, chunk_size=3)])
def test_the_drafter_gets_the_targets_hidden_states(setup, engine):
    _, target, _ = setup
    plain = outputs(run(target, None))
    answers = {i: p + out for i, (p, out) in enumerate(zip(PROMPTS, plain))}
    recorder = Recorder(answers)
    spec = Speculator(SpecOptions("recorder", "chain"), recorder, FixedController(3), parse_shape("chain"))
    assert spec.hidden_layers == (3, 1)
    assert outputs(run(target, spec, **engine)) == plain
    for i, tokens in answers.items():
        got = torch.cat(recorder.seen[i])  # [n, 2, E]: prompt rows, then each round's accepted path
        assert got.shape[1:] == (2, 64) and any(h.shape[0] > 1 for h in recorder.seen[i][1:])
        cache = target.new_cache(1, 64)
        out = target.forward(pack([0], [0], [torch.tensor(tokens)], logits="none", hidden_layers=(1, 3)), cache)
        want = torch.stack([out.hidden[3][0], out.hidden[1][0]], dim=1)[: got.shape[0]]  # [n, 2, E]
        assert got.shape[0] >= len(tokens) - 1 - 3  # up to the last round's cut (16 new tokens asked for)
        assert torch.allclose(got, want, atol=1e-4)


def test_a_shared_prompt_is_prefilled_again_for_a_drafter_that_reads_hidden_states(setup):
    """prefill_from copies K/V rows, not the prompt's hidden states: a drafter that declares
    needs_hidden gets the request prefilled (and its taps) anyway."""
    _, target, _ = setup
    plain = outputs(run(target, None))[0]
    recorder = Recorder({0: PROMPTS[0] + plain, 1: PROMPTS[0] + plain})
    spec = Speculator(SpecOptions("recorder", "chain"), recorder, FixedController(3), parse_shape("chain"))
    engine = EngineLoop(target, set(), spec, max_running=2, max_len=64)
    first = engine.add(Request(list(PROMPTS[0]), 16))
    engine.step()  # the first decodes: its prompt is in the cache
    second = engine.add(Request(list(PROMPTS[0]), 16, prefill_from=first))
    done = {}
    while engine.has_work:
        done.update({e.request_id: e.completion for e in engine.step() if e.completion is not None})
    for rid in (first, second):
        assert (done[rid].token_ids, done[rid].error) == (plain, None)
        assert recorder.seen[rid][0].shape == (len(PROMPTS[0]) - 1, 2, 64)  # the prompt's taps at start


@pytest.mark.parametrize("kind", ["q8_0", "q4_0", pytest.param("q4_0-i8", marks=pytest.mark.skipif(
    not native.i8_available(), reason="int8-activation kernel: not on this CPU (it needs AVX2)"))])
@pytest.mark.parametrize("tree", ["chain", "dynamic:3,8"])
def test_a_quantized_head_drafts_and_changes_no_output(setup, kind, tree):
    """`eagle3:PATH@q8_0`: the head's matrices kept as blocks (drafting reads fewer bytes); its
    proposals may differ from the float head's, what is committed may not."""
    from outrider.kernels.quant_linear import QuantLinear

    folder, target, head = setup
    spec = Speculator.build(SpecOptions(f"eagle3:{head}@{kind}", tree, "fixed:3"), target, folder)
    w = spec.drafter.head.w
    assert all(isinstance(getattr(w, n), QuantLinear) for n in ("fc", "qkv", "o", "gate_up", "down", "lm_head"))
    assert isinstance(w.norm, torch.Tensor) and isinstance(w.embed, torch.Tensor)  # the target's, shared
    fast = run(target, spec)
    assert outputs(fast) == outputs(run(target, None))
    assert sum(f.round_stats.committed for f in fast) > sum(f.round_stats.rounds for f in fast)


def test_head_dtype_default_and_bad_names(setup):
    from types import SimpleNamespace

    from outrider.drafters.eagle3 import head_dtype, parse_argument
    from outrider.errors import ConfigError
    from outrider.kernels import native

    folder, target, head = setup
    quantized = SimpleNamespace(quantization="q4", device=torch.device("cpu"))
    assert head_dtype(None, target) is None  # a float target: the head drafts in its dtype
    assert head_dtype(None, quantized) == ("q4_0" if native.available() else None)
    i8 = SimpleNamespace(quantization="q4-i8", device=torch.device("cpu"))
    assert head_dtype(None, i8) == ("q4_0-i8" if native.available() else None)  # as the target multiplies
    assert head_dtype("float", quantized) is None and head_dtype("q4_0", target) == "q4_0"
    assert parse_argument(f"{head}@q8_0") == f"{head}@q8_0"
    with pytest.raises(ConfigError, match="must be one of q8_0, q4_0, q4_1, q8_0-i8, q4_0-i8, q4_1-i8, float"):
        parse_argument(f"{head}@int3")
    import shutil

    odd = shutil.copytree(head, head.parent / "head@v2")  # a folder whose name holds '@'
    assert parse_argument(str(odd)) == str(odd)


def test_a_quantized_head_runs_the_native_layer_like_the_torch_one(setup):
    """`@q8_0` on a CPU: the head's layer is one native call (kernels/decoder_layer.py, with the
    caller's [norm(embedding) ; norm(hidden)] as its input); the same logits as its torch layer."""
    from outrider.kernels import native

    if not native.available():
        pytest.skip(native.reason())
    folder, target, head = setup
    results = []
    for use_native in (True, False):
        spec = Speculator.build(SpecOptions(f"eagle3:{head}@q8_0", "chain", "fixed:3"), target, folder)
        h = spec.drafter.head
        h._native = None if use_native else False
        cache = h.new_cache(2, 32)
        batch = pack([0, 1], [0, 0], [torch.tensor([3, 4, 5]), torch.tensor([6, 7])], scratch_row=cache.scratch_row)
        hidden = torch.randn(2, 3, h.config.hidden_size, generator=torch.Generator().manual_seed(0))
        logits, out = h.forward(batch, cache, hidden)
        assert (h._native is not False) == use_native
        results.append((logits, out, cache.k[0].clone()))
    (a, ha, ka), (b, hb, kb) = results
    assert torch.allclose(a, b, rtol=1e-4, atol=1e-4) and torch.allclose(ha, hb, rtol=1e-4, atol=1e-4)
    assert torch.allclose(ka, kb, rtol=1e-4, atol=1e-5)


class _StopAfter(FixedController):
    """fixed:6 whose budgets carry a `stop` that halts a chain after `after` drafts (the hook
    `--controller entropy` drafts by), recording each proposal's entropies and tree size."""

    def __init__(self, after: int):
        super().__init__(6)
        self.after, self.told, self.sizes = after, [], []

    def budget(self, seq_id):
        def stop(entropies):
            self.told.append(list(entropies))
            return len(entropies) >= self.after

        return Budget(depth=6, nodes=6, stop=stop)

    def observe(self, seq_id, tree, result):
        self.sizes.append(tree.size)


def test_the_chain_honours_budget_stop(setup):
    """Issue 43: the EAGLE-3 chain once ignored Budget.stop, so `--controller entropy` drafted
    MAX deep every round. A stop after 2 drafts gives chains of 2, told the entropies (nats over
    the draft vocabulary) of each draft's distribution; greedy output stays plain's."""
    folder, target, head = setup
    plain = outputs(run(target, None))
    spec = Speculator.build(SpecOptions(f"eagle3:{head}", "chain", "fixed:6"), target, folder)
    spec.controller = _StopAfter(2)
    assert outputs(run(target, spec)) == plain
    assert spec.controller.sizes and max(spec.controller.sizes) == 3  # root + 2 drafts, never 6
    told = spec.controller.told
    assert {len(e) for e in told} == {1, 2} and all(0.0 <= h <= math.log(6) + 1e-6 for e in told for h in e)
    entropy = Speculator.build(SpecOptions(f"eagle3:{head}", "chain", "entropy:6"), target, folder)
    assert outputs(run(target, entropy)) == plain
    assert sum(entropy.controller.seen) > 0  # it was told the entropies and learned from the rounds
