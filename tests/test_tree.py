"""spec/tree.py on the module's worked example and on every defect tree_problem names, word for word
(mutation testing, issue 29: these functions build the attention masks and positions of every
verify forward, and refuse a drafter's broken tree before it)."""

import pytest
import torch

from outrider.spec.tree import ancestor_mask, children, depths, leaf_paths, tree_problem

PARENTS = [-1, 0, 0, 1, 1, 2, 3, 0, 7]  # node 0 the root; leaves 4, 5, 6, 8


def test_depths_masks_paths_and_children_of_a_tree():
    parents = torch.tensor(PARENTS)
    got = depths(parents)
    assert got.tolist() == [0, 1, 1, 2, 2, 2, 3, 1, 2] and got.dtype == torch.long
    mask = ancestor_mask(parents)
    assert mask.dtype == torch.bool and mask.shape == (9, 9)
    expected = torch.zeros(9, 9, dtype=torch.bool)
    for i, ancestors in enumerate([[0], [0, 1], [0, 2], [0, 1, 3], [0, 1, 4], [0, 2, 5], [0, 1, 3, 6], [0, 7],
                                   [0, 7, 8]]):
        expected[i, ancestors] = True
    assert torch.equal(mask, expected)
    assert leaf_paths(PARENTS) == [[0, 1, 4], [0, 2, 5], [0, 1, 3, 6], [0, 7, 8]]
    assert children(PARENTS) == [[1, 2, 7], [3, 4], [5], [6], [], [], [], [8], []]


@pytest.mark.parametrize("parents, paths", [
    ([-1], [[0]]),  # the root alone is a leaf
    ([-1, 0], [[0, 1]]),
    ([-1, 0, 0], [[0, 1], [0, 2]]),
    ([-1, 0, 1, 2], [[0, 1, 2, 3]]),
])
def test_leaf_paths_of_small_trees(parents, paths):
    assert leaf_paths(parents) == paths


OK_TOKENS, OK_PARENTS = torch.tensor([5, 6, 7]), torch.tensor([-1, 0, 1])


@pytest.mark.parametrize("tokens, parents, probs, message", [
    (OK_TOKENS, torch.tensor([-1, 0]), None, "tokens (3,) and parents (2,) must both be [n], n >= 1"),
    (OK_TOKENS.view(3, 1), OK_PARENTS, None, "tokens (3, 1) and parents (3,) must both be [n], n >= 1"),
    (torch.tensor([[5]]), torch.tensor([-1]), None, "tokens (1, 1) and parents (1,) must both be [n], n >= 1"),
    (OK_TOKENS, OK_PARENTS.view(3, 1), None, "tokens (3,) and parents (3, 1) must both be [n], n >= 1"),
    (torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long), None,
     "tokens (0,) and parents (0,) must both be [n], n >= 1"),
    (OK_TOKENS.int(), OK_PARENTS, None, "tokens and parents must be int64 tensors, got torch.int32 and torch.int64"),
    (OK_TOKENS, OK_PARENTS.int(), None, "tokens and parents must be int64 tensors, got torch.int64 and torch.int32"),
    (OK_TOKENS, OK_PARENTS, torch.ones(2, 96), "draft_probs (2, 96) must be [n=3, vocab]"),
    (OK_TOKENS, OK_PARENTS, torch.ones(3), "draft_probs (3,) must be [n=3, vocab]"),
    (OK_TOKENS, OK_PARENTS, torch.ones(3, 3, 96), "draft_probs (3, 3, 96) must be [n=3, vocab]"),
    (OK_TOKENS, torch.tensor([5, 0, 1]), None, "node 0 (the root) must have parent -1, got 5"),
    (OK_TOKENS, torch.tensor([-1, 1, 0]), None,
     "node 1 has parent 1; parents must point to an earlier node (0 <= parent < 1)"),
    (OK_TOKENS, torch.tensor([-1, 0, -1]), None,
     "node 2 has parent -1; parents must point to an earlier node (0 <= parent < 2)"),
    (torch.tensor([5, 96, 7]), OK_PARENTS, None, "node 1 holds token 96, outside the target's vocabulary [0, 96)"),
    (torch.tensor([-1, 6, 7]), OK_PARENTS, None, "node 0 holds token -1, outside the target's vocabulary [0, 96)"),
])
def test_tree_problem_word_for_word(tokens, parents, probs, message):
    assert tree_problem(tokens, parents, probs, 96) == message


@pytest.mark.parametrize("tokens, parents, probs", [
    (OK_TOKENS, OK_PARENTS, None),
    (OK_TOKENS, OK_PARENTS, torch.ones(3, 96)),
    (OK_TOKENS, OK_PARENTS, torch.ones(3, 100)),  # a drafter's vocabulary may be wider
    (torch.tensor([0, 95]), torch.tensor([-1, 0]), torch.ones(2, 96)),  # the vocabulary's ends
    (torch.tensor([7]), torch.tensor([-1]), None),
    (torch.tensor([5, 6, 7, 8, 9]), torch.tensor(PARENTS[:5]), None),
])
def test_well_formed_trees_have_no_problem(tokens, parents, probs):
    assert tree_problem(tokens, parents, probs, 96) is None
