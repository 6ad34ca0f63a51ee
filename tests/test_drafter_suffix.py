"""SuffixDecoding: the suffix tree's counts against a brute-force count of windows (while growing,
after evictions), incremental matching against a brute-force search, and whole proposals against
a reference drafter that recounts everything from the raw token lists."""

import random

import pytest

from outrider.drafters.suffix import SuffixDrafter, speculate
from outrider.drafters.suffix_tree import SuffixTree
from outrider.errors import ConfigError
from outrider.spec.types import Budget, DraftTree, VerifyResult


def brute_counts(sequences: list[list[int]], max_depth: int) -> dict[tuple[int, ...], int]:
    """count(w) = number of (sequence, start) whose window starts with w."""
    counts: dict[tuple[int, ...], int] = {}
    for seq in sequences:
        for start in range(len(seq)):
            for end in range(start + 1, min(start + max_depth, len(seq)) + 1):
                path = tuple(seq[start:end])
                counts[path] = counts.get(path, 0) + 1
    return counts


def brute_children(sequences: list[list[int]], max_depth: int):
    """children(path) for `speculate`, recounted from the raw sequences on every call."""

    def children(path: tuple[int, ...], min_share: float = 0.0):  # as SuffixTree.continuations
        follow: dict[int, int] = {}
        if len(path) < max_depth:
            for seq in sequences:
                for start in range(len(seq) - len(path)):
                    if tuple(seq[start : start + len(path)]) == path:
                        token = seq[start + len(path)]
                        follow[token] = follow.get(token, 0) + 1
        return sum(follow.values()), [(token, count, path + (token,)) for token, count in follow.items()]

    return children


def reference_proposal(drafter: SuffixDrafter, tokens: list[int], outputs: list[list[int]], budget: Budget):
    """What SuffixDrafter should propose, from raw token lists: (drafts, parents), source."""
    best, source = None, "none"
    for name, sequences in (("request", [tokens]), ("global", outputs)):
        children = brute_children(sequences, drafter.max_depth)
        usable = [n for n in range(min(drafter.max_match, len(tokens)), 0, -1) if children(tuple(tokens[-n:]))[1]]
        length = usable[0] if usable else 0
        while length >= 1:
            max_spec = min(budget.nodes, int(drafter.alpha * length))
            if max_spec <= (best.score if best else 0.0):
                break
            spec = speculate(children, tuple(tokens[-length:]), max_spec, budget.depth, drafter.min_prob)
            if spec.tokens and (best is None or spec.score > best.score):
                best, source = spec, name
            length //= 2
    return ([], []) if best is None else (best.tokens, best.parents), source


def check_shape(tree: DraftTree, root: int, budget: Budget) -> None:
    parents = tree.parents.tolist()
    assert tree.tokens[0].item() == root
    assert parents[0] == -1 and all(0 <= p < i for i, p in enumerate(parents) if i > 0)
    assert tree.size - 1 <= budget.nodes
    depth = [0] * tree.size
    for i in range(1, tree.size):
        depth[i] = depth[parents[i]] + 1
    assert max(depth) <= budget.depth
    assert tree.draft_probs is None


def chain_path(tree: DraftTree) -> list[int]:
    """Drafts along the first child of each node (the best path when scores decrease)."""
    parents = tree.parents.tolist()
    path, node = [], 0
    while node in parents:
        node = parents.index(node)
        path.append(tree.tokens[node].item())
    return path


# -- the suffix tree ---------------------------------------------------------------------------


def test_worked_example():
    tree = SuffixTree(max_depth=3)
    tree.extend(0, [1, 2, 1, 2])
    assert tree.counts() == brute_counts([[1, 2, 1, 2]], 3)
    assert tree.find([1, 2]).count == 2 and tree.find([2, 1, 2]).count == 1
    assert tree.find([2, 2]) is None and tree.find([1, 2, 1, 2]) is None  # deeper than max_depth
    total, options = tree.continuations(tree.find([2]))
    assert total == 1 and [(t, c) for t, c, _ in options] == [(1, 1)]  # the window `b` at 3 ended


@pytest.mark.parametrize("max_depth", [1, 2, 5])
def test_counts_match_brute_force_while_growing_and_after_removal(max_depth):
    rng = random.Random(max_depth)
    tree = SuffixTree(max_depth)
    stored: dict[int, list[int]] = {}
    mismatches = 0
    for key in range(12):
        stored[key] = []
        for _ in range(rng.randrange(1, 6)):  # grow in chunks
            chunk = [rng.randrange(3) for _ in range(rng.randrange(0, 7))]
            tree.extend(key, chunk)
            stored[key] += chunk
            mismatches += tree.counts() != brute_counts(list(stored.values()), max_depth)
        if rng.random() < 0.5:  # remove a random earlier sequence
            victim = rng.choice(list(stored))
            tree.remove(victim)
            del stored[victim]
            mismatches += tree.counts() != brute_counts(list(stored.values()), max_depth)
        assert tree.num_tokens == sum(map(len, stored.values()))
    for key in list(stored):
        tree.remove(key)
    assert tree.counts() == {} and tree.num_nodes() == (1, 0)
    print(f"Match: {mismatches == 0}")
    assert mismatches == 0


def test_unique_text_is_one_leaf_per_token():
    tree = SuffixTree(max_depth=64)
    tree.extend(0, list(range(1000)))
    assert tree.num_nodes() == (1, 1000)


def test_repeated_suffixes_match_brute_force():
    rng = random.Random(3)
    max_depth = 6
    tree = SuffixTree(max_depth)
    seq: list[int] = []
    for _ in range(200):
        token = rng.randrange(3)
        tree.extend(0, [token])
        seq.append(token)
        counts = brute_counts([seq], max_depth)
        expected = [
            length
            for length in range(max_depth - 1, 0, -1)
            if length <= len(seq) and counts[tuple(seq[len(seq) - length :])] >= 2
        ]
        found = tree.repeated_suffixes()
        assert [length for length, _ in found] == expected
        for length, node in found:
            assert node.count == counts[tuple(seq[len(seq) - length :])]


def check_ranked_children(tree: SuffixTree) -> None:
    """Every node: total == sum of its children's counts; `continuations` gives `rank` children
    none of which is less frequent than a child it leaves out."""
    stack = [tree.root]
    while stack:
        node = stack.pop()
        counts = {t: c.count for t, c in node.children.items()}
        total, options = tree.continuations(node)  # min_share 0: all (up to rank)
        assert total == sum(counts.values())
        given = {t: c for t, c, _ in options}
        assert len(given) == min(len(counts), tree.rank or len(counts))
        assert all(counts[t] == c for t, c in given.items())
        left_out = [c for t, c in counts.items() if t not in given]
        assert not left_out or min(given.values()) >= max(left_out)
        stack += [c for c in node.children.values() if hasattr(c, "children")]


def test_ranked_children_stay_the_most_frequent():
    rng = random.Random(11)
    tree = SuffixTree(max_depth=4, rank=3)
    keys = []
    for key in range(30):
        for _ in range(rng.randrange(1, 4)):
            tree.extend(key, rng.choices(range(10), weights=range(10, 0, -1), k=rng.randrange(1, 12)))
            check_ranked_children(tree)  # also builds the lists that later extends maintain
        keys.append(key)
        if rng.random() < 0.3:
            tree.remove(keys.pop(0))
            check_ranked_children(tree)


def test_only_the_last_sequence_grows():
    tree = SuffixTree(4)
    tree.extend(0, [1, 2])
    tree.extend(1, [3])
    with pytest.raises(RuntimeError):
        tree.extend(0, [4])


# -- the drafter -------------------------------------------------------------------------------


def test_parameters_are_validated():
    for bad in [dict(max_depth=1), dict(max_match=64), dict(max_match=0), dict(alpha=0.0), dict(min_prob=1.5)]:
        with pytest.raises(ConfigError):
            SuffixDrafter(**bad)


def test_own_text_is_found_by_the_per_request_tree():
    drafter = SuffixDrafter(alpha=4.0)
    phrase = [10, 11, 12, 13, 14, 15, 16]
    prompt = [1, 2, *phrase, 3, 4]
    drafter.start(0, prompt)
    tokens = prompt + phrase[:2]
    drafter.update(0, VerifyResult([0], phrase[:2]))
    budget = Budget(depth=8, nodes=8)
    tree = drafter.propose(0, tokens, budget)
    check_shape(tree, phrase[1], budget)
    # the phrase, what followed it in the prompt, then the phrase again (its start was just committed)
    assert tree.is_chain() and tree.tokens[1:].tolist() == [*phrase[2:], 3, 4, 10]


def test_a_shorter_match_wins_in_a_repeat():
    tokens = [5] + [7] * 9  # the longest earlier match (8 sevens) is followed by one seven only
    drafter = SuffixDrafter()
    drafter.start(0, tokens)
    tree = drafter.propose(0, tokens, Budget(depth=8, nodes=8))
    assert tree.is_chain() and tree.tokens[1:].tolist() == [7] * 4  # the match of 4: four sevens after


def test_no_match_is_root_only():
    drafter = SuffixDrafter()
    drafter.start(0, [1, 2, 3, 4])
    tree = drafter.propose(0, [1, 2, 3, 4], Budget(4, 4))
    assert tree.tokens.tolist() == [4] and tree.parents.tolist() == [-1]


def test_alpha_scales_speculation_with_match_length():
    prompt = list(range(20)) + [99] + list(range(19))  # the suffix 0..18 matches 19 tokens
    after = [19, 99, *range(19)]
    budget = Budget(depth=64, nodes=64)
    for alpha, expected in [(1.0, 19), (0.5, 9), (0.1, 1)]:
        drafter = SuffixDrafter(max_depth=64, max_match=32, alpha=alpha)
        drafter.start(0, prompt)
        tree = drafter.propose(0, prompt, budget)
        assert tree.is_chain() and tree.tokens[1:].tolist() == after[:expected]
    drafter = SuffixDrafter(max_depth=64, max_match=32, alpha=0.04)  # int(0.04 * 19) == 0
    drafter.start(0, prompt)
    assert drafter.propose(0, prompt, budget).size == 1
    drafter = SuffixDrafter(max_depth=64, max_match=16, alpha=1.0)  # the match counts as 16
    drafter.start(0, prompt)
    assert drafter.propose(0, prompt, budget).tokens[1:].tolist() == after[:16]
    # windows of 20 tokens: below the match of 16 lie 4 tokens, of 8 lie 12, of 4 lie 16 (the best)
    drafter = SuffixDrafter(max_depth=20, max_match=16, alpha=4.0)
    drafter.start(0, prompt)
    assert drafter.propose(0, prompt, budget).tokens[1:].tolist() == after[:16]


def test_branches_follow_frequencies_and_min_prob():
    # longest match (0, 1, 2): followed by 3 twice, 4 once, 5 once -> 0.5, 0.25, 0.25
    prompt = [1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 4, 0, 1, 2, 5, 0, 1, 2]
    drafter = SuffixDrafter(alpha=4.0, min_prob=0.25)
    drafter.start(0, prompt)
    tree = drafter.propose(0, prompt, Budget(depth=1, nodes=8))
    assert tree.tokens.tolist() == [2, 3, 4, 5] and tree.parents.tolist() == [-1, 0, 0, 0]
    drafter = SuffixDrafter(alpha=4.0, min_prob=0.3)
    drafter.start(0, prompt)
    assert drafter.propose(0, prompt, Budget(depth=1, nodes=8)).tokens.tolist() == [2, 3]
    tree = drafter.propose(0, prompt, Budget(depth=3, nodes=8))  # 3 then the rest of its context
    assert tree.is_chain() and tree.tokens.tolist() == [2, 3, 0, 1]


def test_budget_min_confidence_raises_the_threshold():
    if "min_confidence" not in Budget.__dataclass_fields__:
        pytest.skip("Budget has no min_confidence in this checkout")
    prompt = [1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 4, 0, 1, 2, 5, 0, 1, 2]  # 3: 0.5, 4 and 5: 0.25
    drafter = SuffixDrafter(alpha=4.0, min_prob=0.1)
    drafter.start(0, prompt)
    assert drafter.propose(0, prompt, Budget(1, 8)).tokens.tolist() == [2, 3, 4, 5]
    assert drafter.propose(0, prompt, Budget(1, 8, min_confidence=0.4)).tokens.tolist() == [2, 3]
    assert drafter.max_nodes(4) == 8


def test_earlier_outputs_help_later_requests():
    output = [40, 41, 42, 43, 44, 45, 46, 47]
    drafter = SuffixDrafter(alpha=4.0)
    budget = Budget(depth=6, nodes=6)
    drafter.start(1, [5, 6])
    assert drafter.propose(1, [5, 6, 40, 41], budget).size == 1  # nothing known yet
    drafter.start(0, [1, 2, 3])
    drafter.finish(0, [1, 2, 3, *output])
    tokens = [5, 6, 40, 41]  # request 1 goes on after the global tree changed
    tree = drafter.propose(1, tokens, budget)
    check_shape(tree, 41, budget)
    assert tree.tokens[1:].tolist() == output[2:8]
    drafter.start(2, [7, 8, 40, 41, 42])
    assert drafter.propose(2, [7, 8, 40, 41, 42], budget).tokens[1:].tolist() == output[3:8]


def test_global_tree_is_bounded_and_evicts_oldest_exactly():
    rng = random.Random(7)
    drafter = SuffixDrafter(max_depth=8, max_match=4, global_max_tokens=50, global_max_sequences=4)
    outputs = []
    for seq_id in range(40):
        prompt = [rng.randrange(4) for _ in range(3)]
        output = [rng.randrange(4) for _ in range(rng.randrange(1, 30))]
        drafter.start(seq_id, prompt)
        drafter.finish(seq_id, prompt + output)
        outputs.append(output)
        tree = drafter.global_tree
        assert tree.num_tokens <= 50 and len(tree.sequences) <= 4
        kept = list(tree.sequences.values())
        assert kept == outputs[len(outputs) - len(kept) :]  # the newest, in order
        assert tree.counts() == brute_counts(kept, 8)


@pytest.mark.parametrize("seed,vocab", [(0, 4), (1, 4), (2, 4), (3, 4), (4, 12), (5, 12)])
def test_proposals_match_reference_after_arbitrary_rounds(seed, vocab):
    rng = random.Random(seed)
    weights = [1.0 / (1 + token) for token in range(vocab)]  # skewed: some continuations dominate

    def draw(count: int) -> list[int]:
        return rng.choices(range(vocab), weights=weights, k=count)

    drafter = SuffixDrafter(
        max_depth=rng.choice([4, 8, 64]),
        max_match=3,
        alpha=rng.choice([0.5, 1.0, 3.0]),
        min_prob=rng.choice([0.0, 0.1, 0.3]) if vocab == 4 else 0.3,  # rank 4 < vocab: ranked lists
        global_max_tokens=60,
        global_max_sequences=3,
    )
    live: dict[int, list[int]] = {}
    mismatches = 0
    sources = {"none": 0, "request": 0, "global": 0}
    for step_index in range(300):
        if len(live) < 3 or rng.random() < 0.05:  # start a request
            seq_id = step_index
            live[seq_id] = draw(rng.randrange(1, 10))
            drafter.start(seq_id, live[seq_id])
        seq_id = rng.choice(list(live))
        tokens = live[seq_id]
        budget = Budget(depth=rng.randrange(0, 6), nodes=rng.randrange(0, 10))
        tree = drafter.propose(seq_id, tokens, budget)
        check_shape(tree, tokens[-1], budget)
        outputs = list(drafter.global_tree.sequences.values())
        expected, source = reference_proposal(drafter, tokens, outputs, budget)
        mismatches += (tree.tokens[1:].tolist(), tree.parents[1:].tolist()) != expected
        sources[source] += 1
        committed = draw(rng.randrange(1, 4))
        drafter.update(seq_id, VerifyResult(list(range(len(committed) - 1)), committed))
        live[seq_id] = tokens + committed
        if rng.random() < 0.1:
            drafter.finish(seq_id, live.pop(seq_id))
    print(f"Match: {mismatches == 0} (proposals by source: {sources})")
    assert mismatches == 0 and sources["request"] > 20 and sources["global"] > 20


def test_resyncs_when_tokens_run_ahead_or_diverge():
    drafter = SuffixDrafter(alpha=4.0)
    drafter.start(0, [1, 2, 3])
    assert drafter.propose(0, [1, 2, 3, 1, 2], Budget(2, 2)).tokens.tolist() == [2, 3, 1]
    assert drafter.propose(0, [4, 5, 4], Budget(1, 1)).tokens.tolist() == [4, 5]
    assert drafter.propose(9, [8, 9, 8], Budget(1, 1)).tokens.tolist() == [8, 9]
