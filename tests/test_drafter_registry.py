"""The drafter registry (issue 9, item 1): drafters by name, with declared capabilities.

- every built-in drafter's declaration gives, for each tree kind it builds, the verifier that
  tests/test_spec_*.py expect of it (greedy and sampled);
- a drafter defined and registered here, in one file's worth of code, runs end to end through
  `generate_ids`: greedy output equals autoregressive output, and sampled output equals plain
  sampling with the same seed (its declaration says "tree without probabilities": tree walk);
- the sibling mode a drafter declares reaches the multi-draft verifier;
- unknown names list the registered ones, in one line; arguments are parsed by their drafter.
"""

import pytest
import torch
from enumerate_law import one_thread
from tiny import make_tiny

from outrider.control.controllers import AdaptiveController, FixedController
from outrider.control.cost import CostController
from outrider.control.profile import VerifyCostProfile
from outrider.drafters import registry
from outrider.drafters.base import DrafterBase
from outrider.drafters.capabilities import Capabilities, Drafts
from outrider.drafters.model import ModelDrafter
from outrider.drafters.ngram import NgramDrafter
from outrider.drafters.registry import DrafterEntry, register, unregister
from outrider.errors import ConfigError
from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.models.config import ModelConfig
from outrider.weights.loader import load_decoder
from outrider.sampling import SamplingParams
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.spec.shapes import parse_shape
from outrider.spec.types import Budget, DraftTree
from outrider.spec.verifiers import VERIFIERS

BUILT_IN_NAMES = ("ngram", "suffix", "draft-model", "early-exit", "hybrid")
GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=0.8, seed=1)


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def vocab8(tmp_path_factory):
    """A target with 8 tokens (drafts are often right, so the speculative paths run)."""
    folder = make_tiny("llama", tmp_path_factory.mktemp("vocab8") / "t", vocab=8, seed=0)
    return folder, load_decoder(folder, "cpu")


# -- the built-in drafters' declarations choose the verifiers the tests of spec/ expect ----------
# (drafter, tree) -> (verifier when greedy, verifier when sampling); "DRAFT" is the tiny draft model
EXPECTED = {
    ("ngram", "chain"): ("greedy_chain", "chain_walk"),
    ("suffix", "chain"): ("greedy_tree", "tree_walk"),
    ("early-exit:1", "chain"): ("greedy_chain", "rejection_chain"),
    ("early-exit:1", "static:2,2"): ("greedy_tree", "tree_walk"),
    ("early-exit:1", "dynamic:2,4"): ("greedy_tree", "tree_walk"),
    ("early-exit:1", "sampled:2,2"): (None, "multidraft_without_replacement"),  # None: refused when greedy
    ("draft-model:DRAFT", "chain"): ("greedy_chain", "rejection_chain"),
    ("draft-model:DRAFT", "static:2,2"): ("greedy_tree", "tree_walk"),
    ("draft-model:DRAFT", "sampled:2,2"): (None, "multidraft_without_replacement"),
    ("draft-model:DRAFT", "dynamic:2,4"): ("greedy_tree", "tree_walk"),
    ("hybrid:draft-model:DRAFT", "chain"): ("greedy_tree", "tree_walk"),  # suffix trees or the other's, no q
    ("hybrid:draft-model:DRAFT", "static:2,2"): ("greedy_tree", "tree_walk"),
    ("hybrid:draft-model:DRAFT", "dynamic:2,4"): ("greedy_tree", "tree_walk"),
}


def test_the_table_covers_every_built_in_drafter_and_tree_kind():
    declared = {(name, kind) for name, entry in registry.entries().items() if name in BUILT_IN_NAMES
                for kind in entry.capabilities.trees}
    covered = {(drafter.partition(":")[0], parse_shape(tree).kind) for drafter, tree in EXPECTED}
    assert declared == covered


@pytest.mark.parametrize("drafter, tree", list(EXPECTED))
def test_declared_capabilities_choose_the_verifier(tiny_folders, drafter, tree):
    folder = tiny_folders["llama"]
    target = load_decoder(folder, "cpu")
    text = drafter.replace("DRAFT", str(tiny_folders["llama-draft"]))
    spec = Speculator.build(SpecOptions(text, tree, "fixed:2"), target, folder)
    greedy, sampled = EXPECTED[(drafter, tree)]
    if greedy is None:  # siblings drawn from q: nothing to draw when greedy
        with pytest.raises(ConfigError, match="needs temperature > 0"):
            spec.verifier_for(GREEDY)
    else:
        assert spec.verifier_for(GREEDY) is VERIFIERS[greedy].verify
    assert spec.verifier_for(SAMPLED) is VERIFIERS[sampled].verify


def test_a_hand_built_speculator_reads_the_registered_or_the_class_declaration(vocab8):
    _, target = vocab8
    chain = parse_shape("chain")
    # registered name: the registry's declaration (a sampled chain of q -> rejection sampling)
    spec = Speculator(SpecOptions("early-exit:1"), ModelDrafter(target, chain, num_layers=1), FixedController(2), chain)
    assert spec.verifier_for(SAMPLED) is VERIFIERS["rejection_chain"].verify
    # a name that is not registered: what the drafter's class declares
    spec = Speculator(SpecOptions("self"), ModelDrafter(target, chain), FixedController(2), chain)
    assert spec.verifier_for(SAMPLED) is VERIFIERS["rejection_chain"].verify

    class Undeclared:
        name = "undeclared"

        def max_nodes(self, depth):
            return depth

    with pytest.raises(TypeError, match="not registered.*declares no capabilities"):
        Speculator(SpecOptions("undeclared"), Undeclared(), FixedController(2), chain)


def test_a_drafter_or_controller_without_a_hook_the_engine_calls_is_refused_when_built():
    """The hooks are declared (drafters/base.py, control/base.py), never looked for in a round:
    what lacks one the engine would call is refused in one line, naming it, before any request."""
    chain = parse_shape("chain")

    class PerSequenceOnly:  # the protocol before the batch hooks were declared
        name, capabilities = "old", Capabilities(trees={"chain": Drafts("chain")})

        def max_nodes(self, depth):
            return depth

        def start(self, seq_id, prompt, params=None):
            pass

        def propose(self, seq_id, tokens, budget):
            return DraftTree.root_only(tokens[-1])

        def update(self, seq_id, result, hidden=None):
            pass

        def finish(self, seq_id, tokens):
            pass

    with pytest.raises(TypeError) as err:
        Speculator(SpecOptions("old"), PerSequenceOnly(), FixedController(2), chain)
    assert str(err.value) == ("drafter 'old' (PerSequenceOnly) lacks propose_batch, update_batch; "
                              "subclass drafters.base.DrafterBase for the defaults")

    class Scores(DrafterBase):  # declares that it reads the verify's scores, keeps the base's refusal
        name = "scores"
        capabilities = Capabilities(trees={"chain": Drafts("chain")}, needs_attention=True)

        def max_nodes(self, depth):
            return depth

    with pytest.raises(TypeError, match=r"^drafter 'scores' \(Scores\) lacks observe_attention;"):
        Speculator(SpecOptions("scores"), Scores(), FixedController(2), chain)

    class NoTrim:  # every hook of the Controller protocol but trim
        name, max_depth = "no-trim", 2

        def __getattr__(self, hook):
            if hook == "trim":
                raise AttributeError(hook)
            return lambda *args: None

    with pytest.raises(TypeError) as err:
        Speculator(SpecOptions("ngram"), NgramDrafter(), NoTrim(), chain)
    assert str(err.value) == ("controller 'no-trim' (NoTrim) lacks trim; "
                              "subclass control.base.PerSequence for the defaults")


# -- a drafter that is one file: defined and registered here, nothing else edited ----------------
class RecentTokens(DrafterBase):
    """Guesses that the next token is one of the last `width` distinct committed tokens, each
    followed by what followed it the last time it was seen: a tree of `width` branches."""

    name = "recent"

    def __init__(self, width: int):
        self.width = width

    def max_nodes(self, depth: int) -> int:
        return self.width * depth

    def start(self, seq_id, prompt, params=None):
        pass

    def propose(self, seq_id: int, tokens: list[int], budget: Budget) -> DraftTree:
        nodes, parents = [tokens[-1]], [-1]
        guesses = list(dict.fromkeys(reversed(tokens)))[: self.width]
        for token in guesses:
            if len(nodes) > budget.nodes:
                break
            nodes.append(token)
            parents.append(0)
            seen = [i for i in range(len(tokens) - 1) if tokens[i] == token]
            for follower in tokens[seen[-1] + 1:][: budget.depth - 1] if seen else []:
                if len(nodes) > budget.nodes:
                    break
                nodes.append(follower)
                parents.append(len(nodes) - 2)
        return DraftTree(torch.tensor(nodes[: budget.nodes + 1]), torch.tensor(parents[: budget.nodes + 1]))

    def update(self, seq_id, result, hidden=None):
        pass

    def finish(self, seq_id, tokens):
        pass


def parse_width(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise ConfigError("recent:W needs a width W >= 1")
    return int(text)


RECENT = DrafterEntry("recent", "recent:W", Capabilities(trees={"chain": Drafts("tree")}),
                      build=lambda width, shape, target, target_path: RecentTokens(width),
                      parse_argument=parse_width)


@pytest.fixture
def recent():
    register(RECENT)
    yield RECENT
    unregister(RECENT.name)


PROMPTS = [[3, 4, 5, 3, 4, 5, 3], [6, 7, 3, 6, 7, 3, 6], [5, 5, 4, 5, 5, 4, 5]]


def outputs(target, spec, params: SamplingParams, n: int = 16):
    return generate_ids(target, [Request(list(p), n, params) for p in PROMPTS], set(), speculation=spec)


def test_a_registered_drafter_runs_end_to_end(vocab8, recent):
    folder, target = vocab8
    spec = Speculator.build(SpecOptions("recent:2", "chain", "fixed:3"), target, folder)
    assert spec.verifier_for(GREEDY) is VERIFIERS["greedy_tree"].verify
    fast = outputs(target, spec, GREEDY)
    assert [f.token_ids for f in fast] == [f.token_ids for f in outputs(target, None, GREEDY)]
    assert sum(f.round_stats.committed for f in fast) > sum(f.round_stats.rounds for f in fast)  # drafts were accepted
    # declared without probabilities: sampled drafts are verified by the tree walk, which
    # commits what plain sampling draws with the same seed
    assert spec.verifier_for(SAMPLED) is VERIFIERS["tree_walk"].verify
    for seed in (1, 2):
        params = SamplingParams(temperature=1.0, seed=seed)
        assert [f.token_ids for f in outputs(target, spec, params)] == \
               [f.token_ids for f in outputs(target, None, params)]


def test_unknown_drafter_lists_the_registered_ones(recent):
    with pytest.raises(ConfigError) as err:
        SpecOptions("warp").check()
    message = str(err.value)
    assert "\n" not in message and message.startswith("--drafter 'warp': unknown drafter")
    for usage in ("ngram", "suffix", "draft-model:NAME", "early-exit:K", "recent:W"):
        assert usage in message
    unregister("recent")
    with pytest.raises(ConfigError, match="unknown drafter") as err:
        SpecOptions("recent:2").check()
    assert "recent:W" not in str(err.value)


def test_arguments_are_parsed_by_their_drafter(recent):
    with pytest.raises(ConfigError, match=r"^--drafter 'recent:x': recent:W needs a width W >= 1$"):
        SpecOptions("recent:x").check()
    with pytest.raises(ConfigError, match="'ngram:3': this drafter takes no argument"):
        SpecOptions("ngram:3").check()
    with pytest.raises(ConfigError, match="applies to model drafters .*the recent drafter takes only --tree chain"):
        SpecOptions("recent:2", "static:2,2").check()


def test_names_are_unique_words():
    with pytest.raises(ValueError, match="already registered"):
        register(DrafterEntry("ngram", "ngram", Capabilities(trees={"chain": Drafts("chain")}), build=None))
    with pytest.raises(ValueError, match="without ':'"):
        DrafterEntry("a:b", "a:b", Capabilities(trees={"chain": Drafts("chain")}), build=None)
    with pytest.raises(ValueError, match="needs gives_probs"):
        Drafts("tree", without_replacement=True)


# -- the other declared facts: sibling mode, models to pull, fit with the target ----------------
@pytest.mark.parametrize("without_replacement, expected", [(False, "multidraft"),
                                                           (True, "multidraft_without_replacement")])
def test_declared_sibling_mode_reaches_the_multidraft_verifier(vocab8, without_replacement, expected):
    _, target = vocab8
    sampled_tree = Drafts("tree", gives_probs=True, without_replacement=without_replacement)

    class SampledTrees(RecentTokens):
        capabilities = Capabilities(trees={"static": sampled_tree})

    shape = parse_shape("static:2,2")
    spec = Speculator(SpecOptions("sampled-trees", "static:2,2"), SampledTrees(2), FixedController(2), shape)
    assert spec.verifier_for(SAMPLED) is VERIFIERS[expected].verify
    assert spec.verifier_for(GREEDY) is VERIFIERS["greedy_tree"].verify


def test_models_and_fit_come_from_the_entry(tiny_folders):
    folder = tiny_folders["llama"]
    config = ModelConfig.load(folder)
    assert SpecOptions("draft-model:some-model").models_needed() == ("some-model",)
    assert SpecOptions("early-exit:1").models_needed() == ()
    assert SpecOptions("early-exit:1").misfit(config, folder) is None
    assert f"has {config.num_layers} layers" in SpecOptions(f"early-exit:{config.num_layers}").misfit(config, folder)
    assert SpecOptions(f"draft-model:{tiny_folders['llama-draft']}").misfit(config, folder) is None
    # a draft model in a dtype of its own: the name before '@' is what is pulled and checked
    assert SpecOptions("draft-model:some-model@q8_0").models_needed() == ("some-model",)
    assert SpecOptions(f"draft-model:{tiny_folders['llama-draft']}@bfloat16").misfit(config, folder) is None
    for bad, says in (("draft-model:some-model@q5", "unknown dtype 'q5'"), ("draft-model:@q4", "folder before the '@'")):
        with pytest.raises(ConfigError, match=says):
            SpecOptions(bad).models_needed()


def test_a_draft_model_in_its_own_dtype_changes_no_output(tiny_folders):
    """The drafter's precision changes its proposals, never what the target commits."""
    from outrider.llm import LLM
    from outrider.engine.generate import generate_ids
    from outrider.engine.request import Request

    target = str(tiny_folders["llama"])
    requests = [Request([5, 6, 7, 5, 6, 7, 5], 12), Request([9, 3, 9, 3], 12)]
    llm = LLM(target, device="cpu")
    plain = [f.token_ids for f in generate_ids(llm.target, requests, set())]
    for dtype, expect in (("bfloat16", torch.bfloat16), ("q8_0", "q8_0"), ("q4_0", "q4_0")):
        llm = LLM(target, drafter=f"draft-model:{tiny_folders['llama-draft']}@{dtype}", controller="fixed:3", device="cpu")
        draft = llm.speculator.drafter.decoder
        assert (draft.quantization or draft.dtype) == expect and llm.target.dtype == torch.float32
        outs = generate_ids(llm.target, requests, set(), speculation=llm.speculator)
        assert [f.token_ids for f in outs] == plain and sum(f.round_stats.drafted for f in outs) > 0


# -- controllers are told the drafting time through their protocol -----------------------------
def test_controllers_observe_the_draft_time(vocab8):
    folder, target = vocab8
    cost = CostController(VerifyCostProfile((1, 4, 16), (1.0, 1.1, 2.0)), max_depth=4)
    for controller in (FixedController(2), AdaptiveController(max_depth=4), cost):
        controller.observe_draft_time(0.0, 1)
    spec = Speculator(SpecOptions("early-exit:1"), ModelDrafter(target, parse_shape("chain"), num_layers=1),
                      cost, parse_shape("chain"))
    outputs(target, spec, GREEDY, n=8)
    assert cost.draft_step_s + cost.draft_fixed_s > 0
