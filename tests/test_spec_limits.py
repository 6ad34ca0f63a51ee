"""Limits and contracts around a round (issue 7, items 8-11): tree-size limit, the draft model's
cache at its capacity, drafted trees validated before the forward, stats of cut rounds."""

import pytest
import torch
from enumerate_law import one_thread
from tiny import make_tiny

from outrider.control.controllers import FixedController
from outrider.drafters.base import DrafterBase
from outrider.drafters.model import ModelDrafter
from outrider.errors import ConfigError
from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.weights.loader import load_decoder
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.spec.shapes import parse_shape
from outrider.spec.tree import tree_problem
from outrider.spec.types import DraftTree


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def two_layers(tmp_path_factory):
    """The issue's model: a tiny random Llama of 2 layers (context 256)."""
    folder = make_tiny("llama", tmp_path_factory.mktemp("two") / "t", layers=2)
    return folder, load_decoder(folder, "cpu")


# -- item 8: a stated limit on tree size ---------------------------------------------------------
def test_huge_static_tree_is_refused_with_the_limit():
    with pytest.raises(ConfigError, match="69904 draft nodes.*limit of 256.*--max-tree-nodes"):
        SpecOptions("early-exit:4", "static:16,16,16,16,16", "fixed:4").check()


def test_limit_is_a_setting():
    SpecOptions("early-exit:1", "static:4,4,4", "fixed:3", max_tree_nodes=100).check()  # 84 nodes
    with pytest.raises(ConfigError, match="84 draft nodes.*limit of 80"):
        SpecOptions("early-exit:1", "static:4,4,4", "fixed:3", max_tree_nodes=80).check()
    with pytest.raises(ConfigError, match="max_tree_nodes"):
        SpecOptions("ngram", max_tree_nodes=0).check()


def test_dynamic_tree_counts_the_nodes_it_feeds():
    """dynamic:16,8 keeps 8 nodes but feeds 16 per depth to the drafter: 16 x 11 at depth 12."""
    with pytest.raises(ConfigError, match="176 draft nodes"):
        SpecOptions("early-exit:1", "dynamic:16,8", "fixed:12", max_tree_nodes=100).check()


def test_limit_applies_to_what_the_drafter_really_makes(two_layers):
    """The suffix drafter may branch to twice the depth: checked once it is built."""
    folder, target = two_layers
    with pytest.raises(ConfigError, match="limit of 10"):
        Speculator.build(SpecOptions("suffix", "chain", "fixed:8", max_tree_nodes=10), target, folder)


def test_cli_refuses_the_issue_tree_at_once(capsys, tiny_folders):
    from outrider.cli import main

    code = main(["generate", "--model", str(tiny_folders["llama"]), "--drafter", "early-exit:1",
                 "--tree", "static:16,16,16,16,16", "w5"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "limit of 256" in err[0]


# -- item 9: the draft model's cache at its capacity --------------------------------------------
@pytest.mark.parametrize("tree", ["chain", "static:3,2,1", "dynamic:4,8"])
def test_model_drafter_cache_across_its_capacity(two_layers, tree):
    """10-token prompt, 240 new tokens: the drafter's 256-row cache fills and must grow by what
    the shape writes (dynamic:4,8 feeds 4 x 5 = 20 rows at depth 6, not 8). Greedy output must
    still equal plain decoding, up to the context's end."""
    folder, target = two_layers
    prompt = list(range(3, 13))
    plain = generate_ids(target, [Request(prompt, 240)], set())[0]
    spec = Speculator.build(SpecOptions("early-exit:1", tree, "fixed:6"), target, folder)
    fast = generate_ids(target, [Request(prompt, 240)], set(), speculation=spec)[0]
    assert fast.token_ids == plain.token_ids and fast.finish_reason == plain.finish_reason


def test_fed_nodes_bound_what_each_shape_writes(two_layers):
    """Count the rows a ModelDrafter really feeds in one proposal against shape.fed_nodes."""
    from outrider.spec.types import Budget

    _, target = two_layers
    for text in ("chain", "static:3,2,1", "static:2,2,2,2", "dynamic:4,8", "dynamic:2,3"):
        shape = parse_shape(text)
        for depth in (1, 2, 4, 6):
            drafter = ModelDrafter(target, shape, num_layers=1)
            drafter.start(0, list(range(3, 20)))
            drafter.propose(0, list(range(3, 20)), Budget(depth, shape.max_drafts(depth)))
            fed = len(drafter._states[0].fed) - 1  # nodes past the root written this round
            assert fed <= shape.fed_nodes(depth), (text, depth)


# -- item 10: trees validated before the forward ------------------------------------------------
def test_tree_problem_names_each_defect():
    ok = DraftTree(torch.tensor([5, 6, 7]), torch.tensor([-1, 0, 1]))
    assert tree_problem(ok.tokens, ok.parents, None, 96) is None
    assert "node 2 has parent 2" in tree_problem(ok.tokens, torch.tensor([-1, 0, 2]), None, 96)
    assert "node 1 has parent 3" in tree_problem(ok.tokens, torch.tensor([-1, 3, 1]), None, 96)
    assert "root" in tree_problem(ok.tokens, torch.tensor([0, 0, 1]), None, 96)
    assert "token 200" in tree_problem(torch.tensor([5, 200, 7]), ok.parents, None, 96)
    assert "must both be [n]" in tree_problem(ok.tokens, torch.tensor([-1, 0]), None, 96)
    assert "draft_probs" in tree_problem(ok.tokens, ok.parents, torch.ones(2, 96), 96)
    assert "int64" in tree_problem(ok.tokens.int(), ok.parents, None, 96)


class BrokenDrafter(DrafterBase):
    """Proposes a tree whose node 2 points at itself."""

    name, gives_probs = "broken", False

    def max_nodes(self, depth):
        return depth

    def start(self, seq_id, prompt, params=None):
        pass

    def propose(self, seq_id, tokens, budget):
        return DraftTree(torch.tensor([tokens[-1], 5, 6]), torch.tensor([-1, 0, 2]))

    def update(self, seq_id, result, hidden=None):
        pass

    def finish(self, seq_id, tokens):
        pass


def test_round_refuses_an_invalid_tree_before_the_forward(two_layers):
    """The request whose drafter proposed an invalid tree fails alone (finish_reason "error",
    nothing committed), before its tree reaches a forward."""
    _, target = two_layers
    spec = Speculator(SpecOptions("ngram", "chain", "fixed:2"), BrokenDrafter(), FixedController(2),
                      parse_shape("chain"))
    calls = []
    forward = target.forward
    target.forward = lambda *a, **k: calls.append(1) or forward(*a, **k)
    try:
        done = generate_ids(target, [Request([3, 4, 5], 8)], set(), speculation=spec)[0]
    finally:
        del target.forward
    assert done.finish_reason == "error" and done.token_ids == []
    assert "node 2 has parent 2" in done.error and "bug in the drafter" in done.error
    assert len(calls) == 1  # the prefill ran; the invalid round's forward did not


# -- item 11: stats count only the tokens kept --------------------------------------------------
def test_stats_do_not_count_tokens_cut_by_the_limit(two_layers):
    """The target drafting for itself: every draft accepted, the first round commits 9 of which 5 stay."""
    _, target = two_layers
    spec = Speculator(SpecOptions("draft-model:self", "chain", "fixed:8"),
                      ModelDrafter(target, parse_shape("chain"), name="draft-model:self"), FixedController(8),
                      parse_shape("chain"))
    f = generate_ids(target, [Request([3, 4, 5, 6], 5)], set(), speculation=spec)[0]
    assert len(f.token_ids) == 5 and f.round_stats.rounds == 1 and f.round_stats.accepted_by_position[0] == 1
    assert f.round_stats.committed == 5  # tau 5.00, not 9.00


def test_stats_of_a_stop_string_reaching_back_over_rounds(tiny_folders):
    """Plain decoding cut by a stop string: tau stays 1.00 (the rounds after the stop's start are
    not counted), the committed tokens are those kept."""
    from outrider import LLM

    llm = LLM(str(tiny_folders["llama"]))
    full = llm.generate("w5 w6 w7", max_new_tokens=12)
    words = full.text.split()
    stop = " ".join(words[4:7])  # three words: the stop string spans three rounds
    cut = llm.generate("w5 w6 w7", max_new_tokens=12, stop=stop)
    assert cut.finish_reason == "stop" and stop not in cut.text
    assert cut.stats["new_tokens"] == len(cut.token_ids) < len(full.token_ids)
    assert cut.stats["rounds"] == cut.stats["committed"] == len(cut.token_ids)
    assert cut.stats["mean_accepted_length"] == 1.0
