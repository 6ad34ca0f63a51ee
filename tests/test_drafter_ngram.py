"""Prompt lookup (n-gram) drafter: hand-built proposals, and the incremental index against a
brute-force scan after arbitrary rounds."""

import random

import pytest

from outrider.drafters.ngram import NgramDrafter
from outrider.errors import ConfigError
from outrider.spec.types import Budget, DraftTree, VerifyResult


def drafts_of(tree: DraftTree) -> list[int]:
    assert tree.is_chain()
    return tree.tokens[1:].tolist()


def check_shape(tree: DraftTree, root: int, budget: Budget) -> None:
    parents = tree.parents.tolist()
    assert tree.tokens[0].item() == root
    assert parents[0] == -1 and all(0 <= p < i for i, p in enumerate(parents) if i > 0)
    assert tree.size - 1 <= min(budget.depth, budget.nodes)
    assert tree.draft_probs is None


def reference_lookup(tokens: list[int], max_ngram: int, min_ngram: int, num_drafts: int) -> list[int]:
    """Brute force: scan back for the most recent earlier occurrence of the last n tokens."""
    length = len(tokens)
    if num_drafts <= 0:
        return []
    for n in range(min(max_ngram, length), min_ngram - 1, -1):
        suffix = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):  # occurrences that end before the last token
            if tokens[start : start + n] == suffix:
                copied = list(tokens)
                for k in range(num_drafts):
                    copied.append(copied[start + n + k])
                return copied[length:]
    return []


def test_repeat_pattern_is_copied():
    drafter = NgramDrafter()
    tokens = [5, 1, 2, 3, 9, 9, 1, 2]
    drafter.start(0, tokens)
    budget = Budget(depth=3, nodes=8)
    tree = drafter.propose(0, tokens, budget)
    check_shape(tree, 2, budget)
    assert drafts_of(tree) == [3, 9, 9]


def test_longest_ngram_wins_and_most_recent_occurrence():
    drafter = NgramDrafter(max_ngram=2)
    # (7, 1) was followed by 4; the 1-gram (1) most recently by 6
    tokens = [7, 1, 4, 0, 1, 6, 7, 1]
    drafter.start(0, tokens)
    assert drafts_of(drafter.propose(0, tokens, Budget(1, 1))) == [4]
    drafter = NgramDrafter(max_ngram=1)
    drafter.start(0, tokens)
    assert drafts_of(drafter.propose(0, tokens, Budget(1, 1))) == [6]


def test_short_period_copies_past_the_end():
    drafter = NgramDrafter()
    tokens = [1, 2, 1, 2, 1, 2]
    drafter.start(0, tokens)
    assert drafts_of(drafter.propose(0, tokens, Budget(5, 5))) == [1, 2, 1, 2, 1]


def test_no_match_is_root_only():
    drafter = NgramDrafter()
    tokens = [1, 2, 3, 4]
    drafter.start(0, tokens)
    tree = drafter.propose(0, tokens, Budget(4, 4))
    assert tree.size == 1 and tree.tokens.tolist() == [4] and tree.parents.tolist() == [-1]


def test_budget_caps_depth_and_nodes():
    drafter = NgramDrafter()
    tokens = list(range(10)) * 3
    drafter.start(0, tokens)
    for budget in [Budget(4, 10), Budget(10, 2), Budget(0, 5), Budget(5, 0)]:
        tree = drafter.propose(0, tokens, budget)
        check_shape(tree, tokens[-1], budget)
        assert tree.size - 1 == min(budget.depth, budget.nodes)


def test_max_nodes_is_the_depth_and_params_are_accepted():
    drafter = NgramDrafter()
    drafter.start(0, [1, 2, 1], params=None)
    assert drafter.max_nodes(5) == 5


def test_parameters_are_validated():
    with pytest.raises(ConfigError):
        NgramDrafter(min_ngram=0)
    with pytest.raises(ConfigError):
        NgramDrafter(max_ngram=2, min_ngram=3)


@pytest.mark.parametrize("max_ngram,min_ngram", [(3, 1), (4, 2), (1, 1)])
def test_incremental_index_matches_brute_force(max_ngram, min_ngram):
    rng = random.Random(max_ngram * 10 + min_ngram)
    drafter = NgramDrafter(max_ngram=max_ngram, min_ngram=min_ngram)
    mismatches = 0
    for seq_id in range(5):
        tokens = [rng.randrange(5) for _ in range(rng.randrange(1, 8))]
        drafter.start(seq_id, tokens)
        for _ in range(60):
            budget = Budget(depth=rng.randrange(0, 7), nodes=rng.randrange(0, 7))
            tree = drafter.propose(seq_id, tokens, budget)
            check_shape(tree, tokens[-1], budget)
            expected = reference_lookup(tokens, max_ngram, min_ngram, min(budget.depth, budget.nodes))
            mismatches += drafts_of(tree) != expected
            committed = [rng.randrange(5) for _ in range(rng.randrange(1, 5))]
            drafter.update(seq_id, VerifyResult(list(range(len(committed) - 1)), committed))
            tokens = tokens + committed
        drafter.finish(seq_id, tokens)
    print(f"Match: {mismatches == 0}")
    assert mismatches == 0


def test_resyncs_when_tokens_run_ahead_or_diverge():
    drafter = NgramDrafter()
    drafter.start(0, [1, 2, 3])
    ahead = [1, 2, 3, 1, 2]  # two tokens committed without update: extended incrementally
    assert drafts_of(drafter.propose(0, ahead, Budget(2, 2))) == [3, 1]
    other = [4, 5, 4]  # a different sequence under the same id: rebuilt
    assert drafts_of(drafter.propose(0, other, Budget(1, 1))) == [5]
    assert drafts_of(drafter.propose(7, [8, 9, 8], Budget(1, 1))) == [9]  # never started
