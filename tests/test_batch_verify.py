"""AngelSpec's batch-level verification allocation (control/batch_verify.py): a shared budget of
drafted nodes per round goes to the highest-confidence prefixes across the requests (checked
against a brute-force top-N over every prefix-closed choice), never more than the budget, every
tree prefix-closed; priced by a cost model it stops at the first step that does not pay; and on a
tiny model, greedy speculation through it equals plain decoding with several requests at once."""

import itertools

import pytest
import torch
from eagle3_tiny import target_with_head
from enumerate_law import one_thread

from outrider.control.batch_verify import BatchVerifyController, allocate, parse
from outrider.control.controllers import parse_controller
from outrider.engine.loop import EngineLoop
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.errors import ConfigError
from outrider.sampling import SamplingParams
from outrider.spec.types import DraftTree
from outrider.weights.loader import load_decoder


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    with one_thread():
        yield


def chain(confidences):
    n = len(confidences)
    return DraftTree(torch.arange(n + 1), torch.arange(-1, n), confidence=torch.tensor([1.0, *confidences]))


def tree():  # root -> a (0.6) -> c (0.5); root -> b (0.3) -> d (0.25), e (0.05)
    return DraftTree(torch.tensor([9, 1, 2, 3, 4, 5]), torch.tensor([-1, 0, 0, 1, 2, 2]),
                     confidence=torch.tensor([1.0, 0.6, 0.3, 0.5, 0.25, 0.05]))


TREES = [chain([0.9, 0.8, 0.4, 0.1]), chain([0.7, 0.2]), tree(), chain([0.95, 0.9, 0.85])]


def best_total(trees, budget):
    """Brute force: the largest summed confidence of any prefix-closed choice of `budget` nodes."""
    nodes = [(i, n) for i, t in enumerate(trees) for n in range(1, t.size)]
    best = 0.0
    for pick in itertools.combinations(nodes, min(budget, len(nodes))):
        chosen = set(pick)
        if all(trees[i].parents[n] == 0 or (i, int(trees[i].parents[n])) in chosen for i, n in chosen):
            best = max(best, sum(float(trees[i].confidence[n]) for i, n in chosen))
    return best


def kept_nodes(trees):
    return sum(t.size - 1 for t in trees)


def closed(t):
    return all(p < i for i, p in enumerate(t.parents.tolist()[1:], start=1)) and int(t.parents[0]) == -1


@pytest.mark.parametrize("budget", [0, 1, 3, 5, 8])
def test_the_budget_goes_to_the_best_prefixes_across_requests(budget):
    kept = allocate(TREES, budget)
    assert kept_nodes(kept) == min(budget, kept_nodes(TREES))  # honoured, and spent
    assert all(closed(t) for t in kept)
    total = sum(float(t.confidence[1:].sum()) for t in kept)
    assert total == pytest.approx(best_total(TREES, budget))


def test_a_tree_without_confidences_is_kept_whole_and_counts_first():
    plain = DraftTree(torch.tensor([1, 2, 3]), torch.tensor([-1, 0, 1]))
    kept = allocate([plain, chain([0.9, 0.8])], 3)
    assert kept[0].size == 3 and kept[1].size == 2


def test_priced_it_stops_at_the_first_step_that_does_not_pay():
    # C(w) = 1 + 0.2 (w - 1), E starts at 2: 0.95 pays (0.95 >= 2 x 0.2), 0.9 fits width 2 free,
    # 0.8 pays (0.8 x 1.2 >= 3.85 x 0.2), 0.3 does not (0.3 x 1.4 < 4.65 x 0.2): the allocation ends there
    kept = allocate([chain([0.9, 0.8, 0.3]), chain([0.95, 0.2])], None, lambda width: 1.0 + 0.2 * (width - 1))
    assert [t.size - 1 for t in kept] == [2, 1]
    dear = allocate([chain([0.9, 0.8, 0.3]), chain([0.95, 0.2])], None, lambda width: 1.0 + 0.5 * (width - 1))
    assert kept_nodes(dear) == 0  # 0.95 < 2 x 0.5: not even the best step pays
    assert kept_nodes(allocate(TREES, None, lambda width: 1.0)) == kept_nodes(TREES)  # free width: all


def test_parse_and_refusals():
    assert parse("4") == (4, None) and parse("3,budget=7") == (3, 7)
    for bad in ("", "x", "0", "3,budget=-1", "3,width=2"):
        with pytest.raises(ConfigError):
            parse(bad)
    assert isinstance(parse_controller("batch-verify:3,budget=4"), BatchVerifyController)


def test_greedy_through_the_allocation_equals_plain_decoding(tmp_path):
    folder, head = target_with_head(tmp_path)
    target = load_decoder(folder, "cpu")
    prompts = [[3, 4, 5, 3, 4, 5, 3], [6, 7, 3, 6, 7, 3, 6], [5], [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4]]

    def run(spec):
        return [f.token_ids for f in EngineLoop(target, set(), spec, max_running=4).run_all(
            [Request(list(p), 16, SamplingParams()) for p in prompts])]

    spec = Speculator.build(SpecOptions(f"eagle3:{head}", "static:2,2,1", "batch-verify:3,budget=5"), target, folder)
    assert run(spec) == run(None)
    assert 0 < spec.controller.verified <= spec.controller.drafted
