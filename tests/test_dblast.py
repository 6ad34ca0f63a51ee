"""DBLast (issue 43 item 4): dependent block drafting with a latent mixture, exact.

Proven here:
- the posterior-marginalised rows (the chain's incremental form and training's batched log form)
  equal explicit Bayes, component by component;
- by exact enumeration on a 3-token toy world, with every draw keyed as PositionalRandom keys it
  (so the reuse of uniforms across rounds is enumerated too): drafts sampled by component and
  verified by rejection sampling with the posterior rows give exactly the target's law; coupled
  drafts under the walk give exactly the plain sample; four mutants of the proposal leave the law
  (the prior's marginal rows, rows conditioned one token too far, the component's draw sharing
  the first draft's uniform); the drawn component's own rows are exact too, but accept less;
- end to end through the engine on a tiny target with a random DFlash head and a random mixture:
  greedy equals plain token for token, a seeded sample equals plain sampling with that seed, and
  the unseeded sample's law passes a chi-square test against the exact autoregressive law, which
  a mutant (prior rows) fails.
"""

from collections import Counter

import pytest
import torch
from enumerate_law import (
    EnumeratingUniforms,
    ToyModel,
    autoregressive_law,
    enumerate_law,
    generate,
    generation_law,
    max_law_difference,
    one_thread,
)
from test_verify_chisquare import chi_square_p_value

from outrider.control.controllers import FixedController
from outrider.drafters import dblast_chain
from outrider.drafters.dblast import DBLastDrafter, parse_argument
from outrider.drafters.dblast_chain import (
    COMPONENT,
    MixtureBlock,
    _chain,
    coupled_chain,
    greedy_mixture_chain,
    posterior_log_rows,
    posterior_rows_reference,
    sampled_by_component,
)
from outrider.drafters.dblast_mixture import MixtureHead, MixtureWeights, load_weights, mixture_reference
from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.errors import ConfigError
from outrider.sampling import SamplingParams
from outrider.spec.shapes import parse_shape
from outrider.spec.types import DraftTree
from outrider.spec.verifiers import VERIFIERS
from outrider.spec.verify_chain import target_probs, verify_chain
from outrider.spec.verify_tree import verify_chain_walk

PROMPT, LENGTH, K = [0, 1], 2, 2
TARGET = ToyModel(3, seed=1)
COMPONENTS = [ToyModel(3, seed=2, scale=2.5), ToyModel(3, seed=5, scale=2.5)]
GATE = ToyModel(3, seed=11)
T1, T07 = SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=2)


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    with one_thread():
        yield


def toy_block(committed: list[int]) -> MixtureBlock:
    """2 components: component z's position k reads toy model z after the context extended by its
    own argmax path (so positions depend on the context, not on the drafts); pi from GATE."""
    rows = []
    for model in COMPONENTS:
        context, own = list(committed), []
        for _ in range(K):
            own.append(model.logits(context).float())
            context.append(int(own[-1].argmax()))
        rows.append(torch.stack(own))
    log_pi = torch.log_softmax(GATE.logits(committed)[:2].float(), -1)  # [M]
    return MixtureBlock(committed[-1], log_pi, torch.stack(rows), 3)


def by_component(params):
    return lambda committed, rng: sampled_by_component(toy_block(committed), K, params, rng.drafting())


def coupled(params):
    return lambda committed, rng: coupled_chain(toy_block(committed), K, params, rng)


def mutant(rows_of, params):
    """Drafts by component as the drafter draws them, carrying the rows `rows_of(probs, pi, z, drafts)`."""
    def propose(committed, rng):
        block, draws = toy_block(committed), rng.drafting()
        probs, pi = block.probs(params), block.pi()
        z = draws.categorical(pi, offset=0, index=COMPONENT)
        drafts = [draws.categorical(probs[z, d], offset=d) for d in range(K)]
        rows = torch.cat((rows_of(probs, pi, z, drafts), torch.zeros(1, 3, dtype=torch.float64)))
        return DraftTree.chain(committed[-1], drafts, rows)
    return propose


COMPONENT_ROWS = lambda probs, pi, z, x: probs[z, : len(x)]  # noqa: E731  (exact too: see below)
MUTANTS = {
    "prior_rows": lambda probs, pi, z, x: torch.einsum("m,mkv->kv", pi, probs[:, : len(x)]),
    "one_token_too_far": lambda probs, pi, z, x: torch.cat((posterior_rows_reference(probs, pi, x)[1:],
                                                            posterior_rows_reference(probs, pi, x)[-1:])),
}


def law(propose, verify, params):
    """The exact law of the generation, every draw independent (rounds composed: enumerate_law.py)."""
    return generation_law(PROMPT, LENGTH, TARGET, propose, verify, params)


def keyed_law(propose, verify, params):
    """The same with draws keyed as PositionalRandom keys them (shared uniforms, across rounds too)."""
    return enumerate_law(lambda rng: generate(PROMPT, LENGTH, rng, TARGET, propose, verify, params),
                         make=EnumeratingUniforms)


def test_posterior_rows_equal_explicit_bayes():
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(3, 4, 5, generator=g, dtype=torch.float64) * 2, -1)  # [M, K, V]
    probs[1, 0, 2] = 0.0  # a component that cannot draw token 2 first
    probs = probs / probs.sum(-1, keepdim=True)
    pi = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    tokens = [2, 0, 4, 1]
    want = posterior_rows_reference(probs, pi, tokens)  # [4, V]
    block = MixtureBlock(9, pi.log(), probs.log().float(), 5)
    chain = _chain(block, probs, 4, lambda d, row: tokens[d], 0.0, None)
    torch.testing.assert_close(chain.draft_probs[:4], want, atol=1e-12, rtol=0)
    batched = posterior_log_rows(probs.log().unsqueeze(0), pi.log().unsqueeze(0), torch.tensor([tokens])).exp()[0]
    torch.testing.assert_close(batched, want, atol=1e-12, rtol=0)
    assert not torch.allclose(want[1], torch.einsum("m,mv->v", pi, probs[:, 1]))  # the prefix does move it
    greedy = greedy_mixture_chain(block, 4).tokens[1:].tolist()  # each draft the argmax of its posterior row
    assert greedy == [int(posterior_rows_reference(probs, pi, greedy)[i].argmax()) for i in range(4)]
    two = torch.tensor([[[0.8, 0.1, 0.1], [0.1, 0.8, 0.1]], [[0.1, 0.1, 0.8], [0.8, 0.1, 0.1]]], dtype=torch.float64)
    mixed = MixtureBlock(9, torch.tensor([0.4, 0.6]).log(), two.log().float(), 3)
    assert greedy_mixture_chain(mixed, 2).tokens.tolist() == [9, 2, 0]  # not component 0's argmax (0, 1)


def test_the_mixture_head_equals_its_reference():
    from test_dflash_spec import head_for

    class Target:  # what head_for reads: a shared embedding and output head
        embed, lm_head = torch.randn(8, 64), torch.randn(8, 64)

    head = head_for(Target())
    mixture = random_mixture(head)
    h, base = torch.randn(head.block_size, 64), torch.randn(head.block_size - 1, 8)
    log_pi, logits = mixture(h, base)
    want_pi, want = mixture_reference(mixture.w, head.w.lm_head, h, base, head.w.norm, head.config.rms_norm_eps)
    torch.testing.assert_close(log_pi, want_pi, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-5)
    assert (logits[0] - logits[1]).abs().max() > 0.1  # the components differ


@pytest.mark.parametrize("params", [T1, T07], ids=["t1", "t0.7_topk2"])
def test_drafts_by_component_with_posterior_rows_are_exact(params):
    expected = autoregressive_law(PROMPT, LENGTH, TARGET, params)
    assert max_law_difference(law(by_component(params), verify_chain, params), expected) < 1e-9
    reference = mutant(lambda probs, pi, z, x: posterior_rows_reference(probs, pi, x), params)
    assert max_law_difference(law(reference, verify_chain, params), expected) < 1e-9


def test_with_positional_uniforms_too():
    """Keyed as production keys them: the component's draw (offset 0, index COMPONENT) and the drafts
    (offset d, index 0) on the drafting streams, reused by later rounds where not committed."""
    assert max_law_difference(keyed_law(by_component(T1), verify_chain, T1),
                              autoregressive_law(PROMPT, LENGTH, TARGET, T1)) < 1e-9


def first_accepted(propose, params) -> float:
    """P(the first draft is accepted), exactly."""
    def fn(rng):
        tree = propose(PROMPT, rng)
        logits = torch.stack([TARGET.logits(PROMPT), TARGET.logits(PROMPT + [int(tree.tokens[1])])])
        return verify_chain(DraftTree.chain(PROMPT[-1], tree.tokens[1:2].tolist(), tree.draft_probs[[0, -1]]),
                            logits, params, rng).num_accepted
    return enumerate_law(fn)[1]


def test_the_drawn_components_own_rows_are_exact_but_accept_less():
    """Rows conditioned on z itself are exact too (given z each draft is drawn from them), but the
    verifier then accepts E_z min(p, q_z) <= min(p, E_z q_z) (min is concave): why DBLast verifies
    with the posterior-marginalised q."""
    expected = autoregressive_law(PROMPT, LENGTH, TARGET, T1)  # (keyed_law: these rows are not a function of
    assert max_law_difference(keyed_law(mutant(COMPONENT_ROWS, T1), verify_chain, T1), expected) < 1e-9  # the tokens)
    assert first_accepted(by_component(T1), T1) > first_accepted(mutant(COMPONENT_ROWS, T1), T1) + 0.01


def test_coupled_drafts_under_the_walk_are_the_plain_sample():
    def paired(rng):
        fast = generate(PROMPT, LENGTH, rng, TARGET, coupled(T1), verify_chain_walk, T1)
        committed = list(PROMPT)
        while len(committed) < len(PROMPT) + LENGTH:
            committed.append(rng.at(len(committed)).categorical(target_probs(TARGET.logits(committed), T1)))
        return fast, tuple(committed[len(PROMPT):])

    pairs = enumerate_law(paired, make=EnumeratingUniforms)
    assert sum(w for (fast, slow), w in pairs.items() if fast != slow) == 0.0
    # and coupling accepts: the first draft is the walk's token more often than an independent draw
    first = enumerate_law(lambda rng: int(coupled(T1)(PROMPT, rng.at(2)).tokens[1]) ==
                          rng.at(2).categorical(target_probs(TARGET.logits(PROMPT), T1)), make=EnumeratingUniforms)
    block = toy_block(PROMPT)
    marginal = torch.einsum("m,mv->v", block.pi(), block.probs(T1)[:, 0])
    assert first[True] > float((marginal * target_probs(TARGET.logits(PROMPT), T1)).sum()) + 0.01


@pytest.mark.parametrize("name", MUTANTS)
def test_mutant_proposals_leave_the_target_law(name):
    expected = autoregressive_law(PROMPT, LENGTH, TARGET, T1)
    assert max_law_difference(law(mutant(MUTANTS[name], T1), verify_chain, T1), expected) > 1e-3


def test_mutant_component_draw_sharing_the_first_drafts_uniform(monkeypatch):
    monkeypatch.setattr(dblast_chain, "COMPONENT", 0)
    expected = autoregressive_law(PROMPT, LENGTH, TARGET, T1)
    assert max_law_difference(keyed_law(by_component(T1), verify_chain, T1), expected) > 1e-3


# -- through the engine ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from tiny import make_tiny

    from outrider.weights.loader import load_decoder

    return load_decoder(make_tiny("llama", tmp_path_factory.mktemp("dblast") / "t", vocab=8, layers=4), "cpu")


def random_mixture(head, seed=1, scale=0.8) -> MixtureHead:
    w = MixtureWeights.init(3, 4, head.block_size - 1, head.config.hidden_size, seed=seed, scale=scale)
    g = torch.Generator().manual_seed(seed)
    w.proj = torch.randn(head.config.hidden_size, 4, generator=g) * scale
    w.gate_bias = torch.randn(3, generator=g)
    return MixtureHead(w, head)


def speculator(target, depth=3):
    from test_dflash_spec import head_for

    head = head_for(target)
    shape = parse_shape("chain")
    drafter = DBLastDrafter(head, random_mixture(head), shape, head.config.taps(target.config.num_layers))
    return Speculator(SpecOptions("dblast:x", "chain", f"fixed:{depth}"), drafter, FixedController(depth), shape)


PROMPTS = [[3, 4, 5, 3, 4, 5, 3], [5], [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4]]


def run(target, spec, params=SamplingParams(), n=12):
    return [f.token_ids for f in generate_ids(target, [Request(list(p), n, params) for p in PROMPTS], set(),
                                              speculation=spec)]


def test_greedy_equals_plain_and_seeded_sampling_equals_plain_sampling(target):
    spec = speculator(target)
    assert spec.verifier_for(SamplingParams()) is VERIFIERS["greedy_chain"].verify
    assert spec.verifier_for(SamplingParams(temperature=1.0)) is VERIFIERS["rejection_chain"].verify
    assert run(target, spec) == run(target, None)
    seeded = SamplingParams(temperature=0.8, seed=5)
    assert run(target, spec, seeded) == run(target, None, seeded)


def engine_p_value(target, spec, runs=300):
    prompt, params = [3, 4, 5], SamplingParams(temperature=1.0)
    torch.manual_seed(0)
    done = generate_ids(target, [Request(list(prompt), 2, params) for _ in range(runs)], set(), speculation=spec)
    counts = Counter(tuple(f.token_ids) for f in done)
    law = {}
    with torch.inference_mode():
        first = target_probs(_last_logits(target, prompt), params)
        for a in range(8):
            second = target_probs(_last_logits(target, prompt + [a]), params)
            for b in range(8):
                law[(a, b)] = float(first[a] * second[b])
    big = {k: v for k, v in law.items() if v * runs >= 5}  # cells too small for chi-square pooled into one
    pooled = Counter()
    for k, c in counts.items():
        pooled[k if k in big else "rest"] += c
    return chi_square_p_value(pooled, {**big, "rest": 1.0 - sum(big.values())}, runs)


def _last_logits(target, ids):
    import dataclasses

    from outrider.models.batch import causal_batch

    cache = target.new_cache(1, len(ids))
    batch = causal_batch([torch.tensor(ids)], scratch_row=cache.scratch_row)
    batch = dataclasses.replace(batch, logits_rows=torch.tensor([[len(ids) - 1]]))
    return target.forward(batch, cache).logits[0, 0].double()


def test_unseeded_sampling_through_the_engine_passes_chi_square_and_a_mutant_fails(target, monkeypatch):
    """The engine's sample against the exact law; the control: rows replaced by the uniform
    distribution (the verifier told the wrong q) must fail with the same runs."""
    spec = speculator(target)
    assert engine_p_value(target, spec) > 1e-4

    def wrong(block, probs, depth, pick, min_confidence, stop):
        tree = _chain(block, probs, depth, pick, min_confidence, stop)
        rows = torch.full_like(tree.draft_probs, 1.0 / tree.draft_probs.shape[-1])
        return DraftTree(tree.tokens, tree.parents, rows, tree.confidence)

    monkeypatch.setattr(dblast_chain, "_chain", wrong)
    assert engine_p_value(target, spec) < 1e-4


def test_cli_argument_and_refusals(tmp_path):
    with pytest.raises(ConfigError, match="no DBLast mixture"):
        parse_argument(f"{tmp_path},mix={tmp_path / 'none.safetensors'}")
    w = MixtureWeights.init(2, 3, 4, 8)
    path = w.save(tmp_path)
    assert parse_argument(f"{tmp_path}") == f"{tmp_path},mix={path}"
    assert load_weights(tmp_path).comp.shape == (2, 3, 8)
    with pytest.raises(ConfigError, match="--tree chain"):
        DBLastDrafter(_FakeHead(), None, parse_shape("ddtree:4"), (1,))


class _FakeHead:
    pass


def test_training_terms_start_at_the_block_and_the_objective_raises_tau():
    """proj = 0: the mixture's tau equals the block's (whole vocabulary and candidates alike); a few
    Adam steps on the acceptance objective raise the mixture's tau on a fixed batch of blocks."""
    from test_dflash_spec import head_for

    from outrider.train.dblast import block_terms

    class Target:
        embed, lm_head = torch.randn(8, 64), torch.randn(8, 64)

    head = head_for(Target())
    g = torch.Generator().manual_seed(3)
    hidden, base = torch.randn(6, head.block_size, 64, generator=g), torch.randn(6, head.block_size - 1, 8, generator=g)
    t_logits = torch.randn(6, head.block_size - 1, 8, generator=g) * 2
    labels = t_logits.argmax(-1)
    w = MixtureWeights.init(3, 4, head.block_size - 1, 64, seed=0, scale=0.3)
    lm_head = head.w.lm_head.float()
    for top in (None, 2):
        tau, base_tau, _ = block_terms(w, lm_head, head, hidden, base, t_logits, labels, 0.7, top)
        torch.testing.assert_close(tau, base_tau)
    params = [w.comp, w.bias, w.proj, w.gate, w.gate_bias]
    for t in params:
        t.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=3e-2)
    for _ in range(30):
        loss = -block_terms(w, lm_head, head, hidden, base, t_logits, labels, 0.7, 2)[0].mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        tau, base_tau, _ = block_terms(w, lm_head, head, hidden, base, t_logits, labels, 0.7)
    assert float(tau.mean()) > float(base_tau.mean()) + 0.05


def test_the_shipped_mixture_loads_with_its_recipe():
    import json
    from pathlib import Path

    from outrider.drafters.dblast import SHIPPED

    folder = SHIPPED / "smollm2-135m-instruct"
    w = load_weights(folder)
    assert (w.components, w.rank, w.positions, w.comp.shape[2]) == (4, 32, 7, 576)  # SmolLM2's DFlash head: H 576, B 8
    assert (folder / "dblast.safetensors").stat().st_size < 25_000_000
    recipe = json.loads((folder / "recipe.json").read_text())
    assert recipe["seed"] == 0 and "python -m outrider.train.dblast" in recipe["command"]
    assert parse_argument("smollm2-135m-instruct").endswith(str(Path("dblast") / "smollm2-135m-instruct" / "dblast.safetensors"))
