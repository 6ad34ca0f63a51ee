"""The rng protocol: PositionalRandom's contract, and the enumerating rng the exactness tests rely on."""

import torch
from enumerate_law import ToyModel, enumerate_law, sampled_tree

from outrider.sampling import SamplingParams
from outrider.spec.random import PositionalRandom, categorical_from_uniform, uniform_reference, uniforms
from outrider.spec.verify_chain import verify_chain, verify_chain_reference
from outrider.spec.verify_multidraft import MultiDraftVerifier
from outrider.spec.verify_tree import verify_tree_walk, verify_tree_walk_reference


def test_enumerate_two_coins():
    law = enumerate_law(lambda rng: rng.uniform_below(0.5) + rng.uniform_below(0.5))
    assert law == {2: 0.25, 1: 0.5, 0: 0.25}


def test_enumerate_skips_impossible_branches_and_depends_on_earlier_draws():
    def fn(rng):
        first = rng.categorical(torch.tensor([0.0, 1.0, 3.0]))  # never 0
        second = rng.uniform_below(1.0) if first == 1 else rng.uniform_below(0.0)
        return first, second

    assert enumerate_law(fn) == {(1, True): 0.25, (2, False): 0.75}


def test_enumerate_rows_are_independent_draws():
    law = enumerate_law(lambda rng: tuple(rng.categorical_rows(torch.tensor([[1.0, 1.0], [1.0, 3.0]])).tolist()))
    assert law == {(0, 0): 0.125, (0, 1): 0.375, (1, 0): 0.125, (1, 1): 0.375}


def test_tensor_uniforms_match_the_python_reference():
    positions = torch.tensor([0, 1, 2, 77, 10**6, 2**40 + 3])
    for seed in (0, 1, 2**63 - 1, 2**63, 2**64 - 1, 123456789):
        for stream, index in ((0, 0), (1, 0), (0, 5), (3, 2)):
            fast = uniforms(seed, positions, stream, index).tolist()
            slow = [uniform_reference(seed, int(p), stream, index) for p in positions]
            assert fast == slow
            assert all(0.0 <= u < 1.0 for u in fast)


def test_uniforms_look_uniform_and_independent_across_keys():
    """Bound: with 20,000 draws the mean and the correlation of two streams are within 0.02 of
    1/2 and 0 (about 7 and 5 standard deviations): a broken mixer fails this, a good one never."""
    positions = torch.arange(20_000)
    a, b = uniforms(5, positions, 0), uniforms(5, positions, 1)
    c = uniforms(6, positions, 0)
    assert abs(float(a.mean()) - 0.5) < 0.02 and abs(float(b.mean()) - 0.5) < 0.02
    for x, y in ((a, b), (a, c), (a[1:], a[:-1])):
        assert abs(float(torch.corrcoef(torch.stack([x, y]))[0, 1])) < 0.02


def test_positional_random_contract():
    rng = PositionalRandom(0)
    assert rng.uniform_below(1.0) and not rng.uniform_below(0.0)
    assert all(rng.categorical(torch.tensor([0.0, 2.0, 0.0]), offset=k) == 1 for k in range(20))
    rows = rng.uniform_below_rows(torch.tensor([0.0, 1.0, 0.0, 1.0], dtype=torch.float64), torch.arange(4))
    assert rows.tolist() == [False, True, False, True]
    drawn = rng.categorical_rows(torch.tensor([[0.0, 1.0], [1.0, 0.0]]), torch.arange(2))
    assert drawn.tolist() == [1, 0]


def test_a_draw_depends_on_its_position_only():
    """No state: the same (seed, position) gives the same token whatever came before or which view asked."""
    probs = torch.tensor([0.2, 0.3, 0.5, 0.0])
    rng = PositionalRandom(7)
    first = [rng.categorical(probs, offset=k) for k in range(30)]
    again = [PositionalRandom(7).at(k).categorical(probs) for k in range(30)]
    rows = PositionalRandom(7).at(10).categorical_rows(probs.expand(20, 4), torch.arange(20)).tolist()
    assert first == again and rows == first[10:30]
    assert len(set(first)) == 3  # all three live tokens appear; the zero-probability one never
    assert first != [PositionalRandom(8).categorical(probs, offset=k) for k in range(30)]
    drafter = PositionalRandom(7).drafting()
    assert [drafter.categorical(probs, offset=k) for k in range(30)] != first  # its own stream


def test_inverse_cdf_never_picks_a_zero_probability_token():
    probs = torch.tensor([[0.0, 1.0, 0.0, 2.0, 0.0]] * 5, dtype=torch.float64)
    u = torch.tensor([0.0, 1 / 3 - 1e-12, 1 / 3, 0.999999, 1.0 - 2.0**-53], dtype=torch.float64)
    assert categorical_from_uniform(probs, u).tolist() == [1, 1, 3, 3, 3]
    assert categorical_from_uniform(probs, torch.full((5,), 1.0 - 2.0**-53)).tolist() == [3] * 5


def test_fast_verifiers_consume_the_same_draws_as_their_references():
    """With the production rng, the vectorized verifiers and the node-by-node references make
    the same decisions from the same per-position uniforms: equal results, seed by seed."""
    target, drafter = ToyModel(5, seed=1), ToyModel(5, seed=2)
    params = SamplingParams(temperature=0.9)
    committed = [0, 1]
    chain, walk = sampled_tree(drafter, [1, 1, 1], False), sampled_tree(drafter, [2, 2], False, probs=False)
    for seed in range(200):
        rng = PositionalRandom(seed).at(len(committed))
        for propose, fast, slow in ((chain, verify_chain, verify_chain_reference),
                                    (walk, verify_tree_walk, verify_tree_walk_reference)):
            tree = propose(committed, rng)
            contexts = [committed + tree.tokens[1 : i + 1].tolist() for i in range(tree.size)]
            if propose is walk:  # a tree's node contexts follow parents
                from enumerate_law import node_contexts

                contexts = node_contexts(committed, tree.tokens.tolist(), tree.parents.tolist())
            logits = torch.stack([target.logits(c) for c in contexts])
            assert fast(tree, logits, params, rng) == slow(tree, logits, params, rng)


def test_no_two_consulted_draws_share_a_key():
    """Every scalar draw a reference verifier makes in one round has its own (stream, offset,
    index): independent uniforms, so the enumeration proofs apply to the production rng."""

    class Recording(PositionalRandom):
        def __init__(self, seed, keys):
            super().__init__(seed)
            self.keys = keys

        def _u(self, offset, stream, index):
            key = (offset, stream, index)
            assert key not in self.keys, f"draw key {key} used twice in one round"
            self.keys.add(key)
            return super()._u(offset, stream, index)

    target, drafter = ToyModel(4, seed=3), ToyModel(4, seed=4)
    params = SamplingParams(temperature=1.3)
    for seed in range(100):
        for propose, verify in ((sampled_tree(drafter, [1, 1, 1], False), verify_chain_reference),
                                (sampled_tree(drafter, [3, 2], True), MultiDraftVerifier(True)),
                                (sampled_tree(drafter, [2, 2], False, probs=False), verify_tree_walk_reference)):
            from enumerate_law import node_contexts

            tree = propose([0, 1], PositionalRandom(seed).drafting())
            contexts = node_contexts([0, 1], tree.tokens.tolist(), tree.parents.tolist())
            logits = torch.stack([target.logits(c) for c in contexts])
            verify(tree, logits, params, Recording(seed, set()))


# -- the exact keys and thresholds behind each draw (mutation testing, issue 29) -------------------
import math  # noqa: E402

import pytest  # noqa: E402

from outrider.spec.random import ACCEPT, DRAFTING, MAX_SEED, TOKEN, _signed  # noqa: E402


def test_signed_gives_the_int64_with_the_same_bits():
    """The mixing constants go into int64 tensors as their bits (not rely on torch wrapping a
    Python int past 2**63 - 1, which a torch version may refuse)."""
    assert [_signed(c) for c in (0, 5, 2**63 - 1, 2**63, 2**64 - 1)] == [0, 5, 2**63 - 1, -2**63, -1]
    assert _signed(0x9E3779B97F4A7C15) == 0x9E3779B97F4A7C15 - 2**64


def test_seeds_are_the_integers_below_two_to_the_64():
    for seed in (0, 1, MAX_SEED - 1):
        assert PositionalRandom(seed).seed == seed
    for bad in (-1, MAX_SEED, 1.0, "3", None):
        with pytest.raises(ValueError) as err:
            PositionalRandom(bad)
        assert str(err.value) == f"seed must be an integer in [0, 2**64), got {bad!r}"


def just_above(x: float) -> float:
    return math.nextafter(x, 2.0)


@pytest.mark.parametrize("view, stream_base, first", [
    (lambda r: r, 0, 0), (lambda r: r.at(9), 0, 9), (lambda r: r.drafting(), DRAFTING, 0),
    (lambda r: r.at(4).drafting(), DRAFTING, 4), (lambda r: r.drafting().at(4), DRAFTING, 4)])
def test_each_draw_is_u_below_its_threshold_at_its_own_key(view, stream_base, first):
    """uniform_below(prob, offset, index) is u < prob with u = uniform_reference(seed, first +
    offset, stream_base + ACCEPT, index): False at prob == u (so prob 0 never accepts), True just
    above. The defaults are offset 0 and index 0; the rows form the same, index 0."""
    seed = 123
    rng = view(PositionalRandom(seed))
    u = lambda offset, stream, index=0: uniform_reference(seed, first + offset, stream_base + stream, index)  # noqa: E731
    assert not rng.uniform_below(u(0, ACCEPT)) and rng.uniform_below(just_above(u(0, ACCEPT)))
    for offset, index in ((0, 1), (3, 0), (5, 2)):
        at = u(offset, ACCEPT, index)
        assert not rng.uniform_below(at, offset=offset, index=index)
        assert rng.uniform_below(just_above(at), offset=offset, index=index)
    offsets = torch.tensor([0, 1, 2, 7])
    exact = torch.tensor([u(o, ACCEPT) for o in offsets.tolist()], dtype=torch.float64)
    assert not rng.uniform_below_rows(exact, offsets).any()
    assert rng.uniform_below_rows(torch.tensor([just_above(x) for x in exact.tolist()], dtype=torch.float64),
                                  offsets).all()


def test_categorical_draws_with_the_whole_float64_uniform():
    """A token boundary between u and u rounded to float32 separates them: categorical and
    categorical_rows (plain sampling and the tree walk use one each) both take the float64 u."""
    seed, found = 11, 0
    for position in range(64):
        u = uniform_reference(seed, position, TOKEN, 0)
        u32 = float(torch.tensor(u, dtype=torch.float32))
        if not 0.5 <= u < 1.0 or u32 == u:
            continue
        b = (u + u32) / 2  # strictly between; in [0.5, 1), so 1 - b is exact and the total is 1
        probs = torch.tensor([b, 1.0 - b], dtype=torch.float64)
        want = 0 if u < b else 1
        assert PositionalRandom(seed).categorical(probs, offset=position) == want
        assert PositionalRandom(seed).at(position).categorical(probs) == want
        assert PositionalRandom(seed).categorical_rows(probs[None], torch.tensor([position])).tolist() == [want]
        # the drafter's samples: the same positions on its own token stream (of [1/2, 1/2]: token 1 iff u >= 1/2)
        ud = uniform_reference(seed, position, DRAFTING + TOKEN, 0)
        assert PositionalRandom(seed).drafting().categorical(torch.tensor([0.5, 0.5]), offset=position) == int(ud >= 0.5)
        found += 1
    assert found >= 10


def test_a_total_rounded_past_the_last_bucket_goes_to_the_last_positive_token():
    """u * total can round up to total (the last cdf entry) on a device whose cumsum is not
    sequential: the draw then goes to the last token with positive probability, never past it
    to a zero-probability one. u = 1 stands for that case here."""
    probs = torch.tensor([[0.2, 0.3, 0.5, 0.0, 0.0], [2.0, 0.0, 3.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.7],
                          [0.0, 4.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    assert categorical_from_uniform(probs, torch.ones(4, dtype=torch.float64)).tolist() == [2, 2, 4, 1]
    assert categorical_from_uniform(probs.float(), torch.ones(4, dtype=torch.float64)).tolist() == [2, 2, 4, 1]
