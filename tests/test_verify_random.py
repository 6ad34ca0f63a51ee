"""The rng protocol: TorchRandom's contract, and the enumerating rng the exactness tests rely on."""

import torch
from enumerate_law import enumerate_law

from outrider.spec.random import TorchRandom


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


def test_torch_random_contract():
    rng = TorchRandom.seeded(0)
    assert rng.uniform_below(1.0) and not rng.uniform_below(0.0)
    assert all(rng.categorical(torch.tensor([0.0, 2.0, 0.0])) == 1 for _ in range(20))
    rows = rng.uniform_below_rows(torch.tensor([0.0, 1.0, 0.0, 1.0], dtype=torch.float64))
    assert rows.tolist() == [False, True, False, True]
    drawn = rng.categorical_rows(torch.tensor([[0.0, 1.0], [1.0, 0.0]]))
    assert drawn.tolist() == [1, 0]


def test_torch_random_is_reproducible_from_its_seed():
    a, b = TorchRandom.seeded(7), TorchRandom.seeded(7)
    probs = torch.tensor([0.2, 0.3, 0.5])
    assert [a.categorical(probs) for _ in range(10)] == [b.categorical(probs) for _ in range(10)]
