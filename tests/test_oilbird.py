"""Oilbird (drafters/oilbird.py): a lexical pool drafter with a second, semantic key over the same pool.

- The lookup: a continuation that exact matching cannot reach (after a fresh token) is found
  through the nearest stored state whose next token is the root, merged into the suffix tree
  under the node budget, and the missed-but-present counter sees it.
- The keys are the target's own states at the pool positions (prefill, then every round).
- The pool's memory bound holds after every change, oldest output evicted first.
- Each lexical base (suffix, ngram, suffix:local): the lookup merges into its tree under its own
  node budget, and with no neighbour near the tree is the base's own.
- Bad options are refused in one line before anything loads.
- Greedy speculative output equals autoregressive output: tiny models of each family (one
  request, a batch, requests one after another through the global pool, a bound small enough to
  evict) and SmolLM2-135M on a prompt whose call repeats with a new value, on each base.
"""

import pytest
import torch
from enumerate_law import one_thread

from outrider.drafters.ngram import NgramDrafter
from outrider.drafters.oilbird import BASES, OilbirdArgument, OilbirdDrafter, merge, parse_argument
from outrider.drafters.registry import parse_drafter
from outrider.drafters.suffix import Speculation, SuffixDrafter
from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.errors import ConfigError
from outrider.models.batch import pack
from outrider.spec.types import Budget, VerifyResult
from outrider.weights.loader import load_decoder

# 61 is fresh (never seen); the state that predicted the root 7 after it is the state at 50,
# which also predicted a 7, followed there by 8 9 3. Exact matching sees only "7", followed by 4 twice.
TOKENS = [5, 50, 7, 8, 9, 3, 7, 4, 3, 7, 4, 2, 61, 7]


def states(n: int, same: tuple[int, int] = (1, 12), dims: int = 8) -> torch.Tensor:
    """[n, 1, dims]: random states in dims 1.., except positions `same`, both the unit e_0."""
    h = torch.randn(n, 1, dims, generator=torch.Generator().manual_seed(0))
    h[:, :, 0] = 0
    for p in same:
        h[p] = 0
        h[p, 0, 0] = 1.0
    return h


def drafter(**options) -> OilbirdDrafter:
    return OilbirdDrafter(layer=1, hidden_size=8, **options)


def test_the_semantic_key_finds_what_exact_matching_misses():
    suffix = SuffixDrafter()
    suffix.start(0, TOKENS)
    plain = suffix.propose(0, TOKENS, Budget(6, 12))
    assert plain.tokens.tolist() == [7, 4]  # the match "7" is one token long: one draft, the frequent 4
    oil = drafter()
    oil.start(0, TOKENS, hidden=states(len(TOKENS) - 1))
    tree = oil.propose(0, TOKENS, Budget(6, 12))
    paths = {tuple(tree.tokens[[*path]].tolist()) for path in _paths(tree.parents.tolist())}
    assert (7, 8, 9, 3, 7, 4) in paths and (7, 4) in paths  # the state's continuation beside the suffix draft
    assert tree.confidence[tree.tokens.tolist().index(8)] == 1.0  # the one neighbour: all of them
    oil.update(0, VerifyResult(accepted_nodes=[1, 2], tokens=[8, 9, 1]), hidden=states(3, same=()))
    stats = oil.stats()
    assert (stats["base_misses"], stats["semantic_present"], stats["semantic_accepted"]) == (1, 1, 2)


def test_no_neighbour_below_the_floor_or_with_another_next_token():
    far = states(len(TOKENS) - 1, same=())  # no state alike
    oil = drafter()
    oil.start(0, TOKENS, hidden=far)
    assert oil.propose(0, TOKENS, Budget(6, 12)).tokens.tolist() == [7, 4]
    other = TOKENS[:-1] + [6]  # 6 never followed the state at 50: its neighbour does not count
    oil.start(1, other, hidden=states(len(other) - 1))
    assert oil.propose(1, other, Budget(6, 12)).size == 1
    assert oil.stats()["lookups"] == 0


@pytest.mark.parametrize("base", ["ngram", "suffix:local"])
def test_the_semantic_key_merges_into_each_base(base):
    """ngram's chain after the 1-gram "7" scores 1/3: the one neighbour's continuation (share 1)
    outranks it within ngram's budget of `depth` nodes; suffix:local keeps its "4" beside it."""
    oil = drafter(base=base)
    oil.start(0, TOKENS, hidden=states(len(TOKENS) - 1))
    tree = oil.propose(0, TOKENS, Budget(6, oil.max_nodes(6)))
    assert tree.size - 1 <= oil.max_nodes(6) == (6 if base == "ngram" else 12)
    paths = {tuple(tree.tokens[[*path]].tolist()) for path in _paths(tree.parents.tolist())}
    assert (7, 8, 9, 3, 7, 4, 3) in paths  # the continuation after the state at 50
    assert ((7, 4) in paths) == (base == "suffix:local")
    assert oil.stats()["semantic_drafted"] == 6 and oil.stats()["lookups"] == 1
    oil.update(0, VerifyResult(accepted_nodes=[1, 2], tokens=[8, 9, 1]), hidden=states(3, same=()))
    stats = oil.stats()
    assert (stats["base"], stats["base_misses"], stats["semantic_present"], stats["semantic_accepted"]) == \
        (base, 1, 1, 2)


def test_with_no_neighbour_the_tree_is_the_bases_own():
    oil = drafter(base="ngram")
    oil.start(0, TOKENS, hidden=states(len(TOKENS) - 1, same=()))
    plain = NgramDrafter()
    plain.start(0, TOKENS)
    tree = oil.propose(0, TOKENS, Budget(6, 6))
    assert tree.tokens.tolist() == plain.propose(0, TOKENS, Budget(6, 6)).tokens.tolist() == [7, 4, 2, 61, 7, 4, 2]
    assert tree.confidence[1:].tolist() == [1 / 3] * 6  # the 1-gram "7"
    for base, kept in (("suffix", 2), ("suffix:local", 0), ("ngram", 0)):  # only suffix keeps finished outputs
        oil = drafter(base=base)
        oil.start(0, TOKENS, hidden=states(len(TOKENS) - 1, same=()))
        oil.propose(0, TOKENS, Budget(6, oil.max_nodes(6)))
        oil.update(0, VerifyResult(accepted_nodes=[1], tokens=[4, 8]), hidden=torch.randn(2, 1, 8))
        oil.finish(0, TOKENS + [4, 8])
        assert oil.global_rows.rows == kept


def test_the_merged_tree_keeps_the_node_budget_best_first():
    suffix = Speculation([4, 5], [0, 1], [0.9, 0.5])
    semantic = [((8,), 1.0), ((8, 9), 1.0), ((8, 9, 3), 0.5), ((4,), 0.25)]
    spec, new = merge(suffix, semantic, max_nodes=3, min_prob=0.1)
    assert (spec.tokens, spec.parents, spec.scores, new) == ([4, 8, 9], [0, 0, 2], [0.9, 1.0, 1.0], 2)
    spec, _ = merge(suffix, semantic, max_nodes=10, min_prob=0.6)
    # the semantic paths below min_prob go; the suffix tree's own nodes stay (it applied min_prob as it grew)
    assert (spec.tokens, spec.parents) == ([4, 8, 5, 9], [0, 0, 1, 2])


def test_the_pool_bound_holds_and_evicts_the_oldest_output():
    oil = drafter(mb=0.004)  # 4194 bytes: 132 bytes a position (64 float16 + an int32) + 1 byte valid
    for seq in range(12):
        prompt = [1, 2, 3]
        oil.start(seq, prompt, hidden=torch.randn(2, 1, 8))
        tokens = list(prompt)
        for step in range(5):
            new = [10 + seq, 20 + step]
            oil.propose(seq, tokens, Budget(4, 8))
            oil.update(seq, VerifyResult(accepted_nodes=[1], tokens=new), hidden=torch.randn(2, 1, 8))
            tokens += new
            assert oil.memory_bytes() <= oil.max_bytes
        oil.finish(seq, tokens)
        assert oil.memory_bytes() <= oil.max_bytes
    assert oil.global_rows.rows == sum(oil.global_lengths) and len(oil.global_lengths) < 12
    assert int(oil.global_rows.nexts[-1]) == 24  # the newest output kept, the oldest gone
    assert oil.stats()["pool_bytes"] == oil.memory_bytes()
    long = drafter(mb=0.002)  # one request longer than the bound: its oldest positions go
    long.start(0, list(range(40)), hidden=torch.randn(39, 1, 8))
    assert long.memory_bytes() <= long.max_bytes and long._own[0].first > 0


@pytest.mark.parametrize("text, why", [
    ("oilbird:0", "K neighbours (1 to 64)"), ("oilbird:x", "K neighbours"), ("oilbird:4,1.5", "SIM in (0, 1]"),
    ("oilbird:4,0", "SIM"), ("oilbird:4,0.7,0", "MB > 0"), ("oilbird:4,0.7,nan", "MB"), ("oilbird:1,2,3,4", "K"),
])
def test_bad_options_are_refused_in_one_line(text, why):
    with pytest.raises(ConfigError) as err:
        SpecOptions(text).check()
    assert str(err.value).startswith(f"--drafter '{text}': oilbird:K[,SIM[,MB]]") and why in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("text, why", [
    ("oilbird:base=eagle3", "oilbird's base=eagle3 is not a lexical base; use one of suffix, ngram, suffix:local"),
    ("oilbird:4,base=", "oilbird's base= is not a lexical base; use one of suffix, ngram, suffix:local"),
    ("oilbird:base=ngram,4", "oilbird:K[,SIM[,MB]][,base=BASE] takes"),  # base= comes last
    ("oilbird:4,k=3", "oilbird:K[,SIM[,MB]][,base=BASE] takes"),
    ("suffix:global", "suffix takes no argument, or `local`"),
])
def test_a_bad_base_is_refused_in_one_line(text, why):
    with pytest.raises(ConfigError) as err:
        SpecOptions(text).check()
    assert str(err.value) == f"--drafter '{text}': {why}" or str(err.value).startswith(f"--drafter '{text}': {why}")
    assert "\n" not in str(err.value)


def test_options_parse():
    assert parse_drafter("oilbird")[1] == parse_argument("") == parse_argument("4,0.7,16") == OilbirdArgument()
    assert parse_argument("").base == "suffix" and BASES == ("suffix", "ngram", "suffix:local")
    assert (parse_argument("8").k, parse_argument("2,0.5").sim, parse_argument("2,0.5,1.5").mb) == (8, 0.5, 1.5)
    assert parse_drafter("oilbird:base=ngram")[1] == OilbirdArgument(base="ngram")
    local = parse_argument("8,0.5,base=suffix:local")
    assert local == OilbirdArgument(8, 0.5, 16.0, "suffix:local") == parse_argument(str(local))
    assert str(local) == "8,0.5,16,base=suffix:local" and str(OilbirdArgument()) == "4,0.7,16"
    assert parse_drafter("suffix:local")[1] == "local"


# -- on a target ------------------------------------------------------------------------------------
PROMPTS = [[3, 4, 5, 3, 4, 5, 3], [6, 7, 3, 6, 7, 3, 6], [5], [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4]]


@pytest.fixture(scope="module")
def targets(tiny_folders):
    return {f: (tiny_folders[f], load_decoder(tiny_folders[f], "cpu")) for f in ("llama", "qwen2", "qwen3")}


@pytest.fixture(scope="module")
def plain_outputs(targets):
    """Each family's greedy output on PROMPTS without drafts: once, for every option drafted against it."""
    return {f: generate(target, None, PROMPTS) for f, (_, target) in targets.items()}


def generate(target, spec, prompts, n=20, together=True):
    with one_thread():
        if together:
            return [f.token_ids for f in generate_ids(target, [Request(list(p), n) for p in prompts], set(),
                                                      speculation=spec)]
        return [generate_ids(target, [Request(list(p), n)], set(), speculation=spec)[0].token_ids for p in prompts]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("option", ["oilbird", "oilbird:8,0.2,0.002", "oilbird:base=ngram",
                                    "oilbird:8,0.2,0.002,base=ngram", "oilbird:8,0.2,base=suffix:local"])
def test_greedy_output_is_autoregressive_on_tiny_models(targets, plain_outputs, family, option):
    folder, target = targets[family]
    plain = plain_outputs[family]
    spec = Speculator.build(SpecOptions(option, "chain", "fixed:4"), target, folder)
    assert spec.hidden_layers == (target.config.num_layers,)
    assert spec.drafter.max_nodes(4) == (4 if "ngram" in option else 8)  # the base's node budget
    assert generate(target, spec, PROMPTS) == plain  # a batch
    assert generate(target, spec, PROMPTS, together=False) == plain  # one after another: the global pool
    assert spec.drafter.memory_bytes() <= spec.drafter.max_bytes
    if ",0.2" in option:
        assert spec.drafter.stats()["lookups"] > 0


def test_seeded_sampling_equals_plain_sampling(targets):
    """Sampling: the trees are verified by the tree walk, so a seeded run commits what plain
    sampling with that seed commits, whatever was drafted."""
    from outrider.sampling import SamplingParams

    folder, target = targets["llama"]
    params = SamplingParams(temperature=0.8, seed=17)
    spec = Speculator.build(SpecOptions("oilbird:4,0.2", "chain", "fixed:4"), target, folder)
    with one_thread():
        plain = [f.token_ids for f in generate_ids(target, [Request(list(p), 20, params) for p in PROMPTS], set())]
        ours = [f.token_ids for f in generate_ids(target, [Request(list(p), 20, params) for p in PROMPTS], set(),
                                                 speculation=spec)]
    assert ours == plain


def test_the_keys_are_the_targets_own_states(targets):
    folder, target = targets["llama"]
    spec = Speculator.build(SpecOptions("oilbird", "chain", "fixed:3"), target, folder)
    prompt = PROMPTS[3]
    (out,) = generate(target, spec, [prompt], n=12)
    tokens = prompt + out
    layer = target.config.num_layers
    full = target.forward(pack([0], [0], [torch.tensor(tokens)], logits="none", hidden_layers=(layer,)),
                          target.new_cache(1, 64))
    want = spec.drafter.keys(full.hidden[layer][0])  # [n, D]: position p's key
    kept = spec.drafter.global_rows  # the output's positions: from the last prompt token on
    start = len(prompt) - 1
    assert kept.rows == len(tokens) - 1 - start
    assert kept.nexts.tolist() == tokens[start + 1:]
    cos = (kept.keys.float() * want[start: start + kept.rows].float()).sum(-1)
    assert bool((cos > 0.999).all())


# -- SmolLM2 ----------------------------------------------------------------------------------------
CALLS = ('call({"id": "a81f", "op": "add", "x": 3, "tag": "red"})\n'
         'call({"id": "c07e", "op": "add", "x": 9, "tag": "blue"})\n'
         'call({"id": "9b2d", "op": "add", "x": 4, "tag": "green"})\n'
         'call({"id": "')


@pytest.fixture(scope="module")
def smollm2_calls(smollm2_decoder, smollm2_tokenizer):
    """The prompt and its autoregressive output (once for every base)."""
    prompt = smollm2_tokenizer(CALLS)["input_ids"]
    with torch.inference_mode(), one_thread():
        return prompt, generate_ids(smollm2_decoder, [Request(list(prompt), 40)], set())[0].token_ids


@pytest.mark.model
@pytest.mark.parametrize("option", ["oilbird", "oilbird:base=ngram"])  # suffix:local: on the tiny models
def test_smollm2_greedy_output_is_autoregressive(smollm2_decoder, smollm2_path, smollm2_calls, option):
    prompt, ar = smollm2_calls
    spec = Speculator.build(SpecOptions(option, "chain", "fixed:6"), smollm2_decoder, smollm2_path)
    with torch.inference_mode(), one_thread():
        sp = generate_ids(smollm2_decoder, [Request(list(prompt), 40)], set(), speculation=spec)[0]
    assert sp.token_ids == ar
    stats = spec.drafter.stats()
    assert stats["lookups"] > 0 and stats["semantic_drafted"] > 0 and stats["semantic_accepted"] > 0


def _paths(parents: list[int]) -> list[list[int]]:
    """Each node's path from the root, as node indices."""
    out = [[0]]
    for parent in parents[1:]:
        out.append(out[parent] + [len(out)])
    return out
