"""Structured outputs with speculation (issue 25 item 3): the grammar masks the target's
distribution at every node along its own path, drafts are pruned at forbidden tokens (greedy and
tree-walk verification) and forced tokens drafted for free; greedy speculative output equals
greedy plain output under every grammar, and the output parses."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("llguidance")

from outrider.control.controllers import FixedController  # noqa: E402
from outrider.drafters.ngram import NgramDrafter  # noqa: E402
from outrider.drafters.suffix import SuffixDrafter  # noqa: E402
from outrider.engine.generate import generate_ids  # noqa: E402
from outrider.engine.request import Request  # noqa: E402
from outrider.engine.speculator import SpecOptions, Speculator  # noqa: E402
from outrider.errors import ConfigError  # noqa: E402
from outrider.sampling import SamplingParams  # noqa: E402
from outrider.spec.grammar import GrammarCompiler, forced_chain  # noqa: E402
from outrider.spec.shapes import parse_shape  # noqa: E402
from outrider.spec.types import DraftTree  # noqa: E402
from outrider.spec.verify_chain import verify_chain  # noqa: E402
from outrider.spec.random import PositionalRandom  # noqa: E402

pytestmark = pytest.mark.model

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"}},
          "required": ["name", "age", "city"], "additionalProperties": False}
TOOL_CALL = {"type": "object", "properties": {
    "name": {"const": "get_weather"},
    "arguments": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                  "required": ["city", "unit"], "additionalProperties": False}},
    "required": ["name", "arguments"], "additionalProperties": False}
GRAMMARS = {
    "json_schema": ("person", {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}),
    "json_object": ("any", {"type": "json_object"}),
    "tool_call": ("tool", {"type": "json_schema", "json_schema": {"name": "call", "schema": TOOL_CALL}}),
}
PROMPTS = {"person": "Describe Alice, 30, from Paris, as JSON.",
           "any": "Reply with a JSON object with one key, ok, set to true.",
           "tool": "What is the weather in Oslo in celsius? Call the tool."}


@pytest.fixture(scope="module")
def smol(smollm2_path, smollm2_tokenizer):
    """The packaged SmolLM2 in its own quantization (the native kernel: the CPU default), its
    tokenizer and end ids, and a grammar compiler for them."""
    from outrider.weights.loader import load_decoder
    from outrider.weights.tokenizer import eos_ids_of

    eos = eos_ids_of(smollm2_path, smollm2_tokenizer)
    target = load_decoder(smollm2_path, "cpu", "q4")
    return target, smollm2_tokenizer, eos, GrammarCompiler(smollm2_tokenizer, 49152, eos)


def chat_ids(tok, text):
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return tok(rendered, add_special_tokens=False)["input_ids"]


def speculators():
    yield "ngram", Speculator(SpecOptions("ngram", "chain", "fixed:4"), NgramDrafter(), FixedController(4),
                              parse_shape("chain"))
    yield "suffix", Speculator(SpecOptions("suffix", "chain", "fixed:6"), SuffixDrafter(), FixedController(6),
                               parse_shape("chain"))


@pytest.mark.parametrize("name", list(GRAMMARS))
def test_greedy_speculative_equals_plain_under_the_grammar(smol, name):
    target, tok, eos, compiler = smol
    key, response_format = GRAMMARS[name]
    grammar = compiler.compile(response_format)
    ids = chat_ids(tok, PROMPTS[key])
    plain = generate_ids(target, [Request(ids, 48, grammar=grammar)], eos)[0]
    text = tok.decode(plain.token_ids, skip_special_tokens=True)
    assert plain.finish_reason == "eos" and isinstance(json.loads(text), dict)  # the output parses
    if name == "tool_call":
        call = json.loads(text)
        assert call["name"] == "get_weather" and call["arguments"]["unit"] in ("c", "f")
    for (label, spec), drafting in zip(speculators(), (False, True)):
        request = Request(ids, 48, grammar=grammar, grammar_drafting=drafting)
        runs = 2 if label == "suffix" else 1  # twice: the second time the suffix trees know the answer
        for done in generate_ids(target, [request] * runs, eos, speculation=spec):
            assert done.token_ids == plain.token_ids, (label, drafting)


def test_forced_tokens_are_drafted_for_free(smol):
    """With grammar-aware drafting the tool call's fixed parts ("name", "get_weather") come as
    forced chains: fewer rounds than the same drafter without it, the same tokens."""
    target, tok, eos, compiler = smol
    grammar = compiler.compile(GRAMMARS["tool_call"][1])
    ids = chat_ids(tok, PROMPTS["tool"])
    rounds = {}
    for drafting in (True, False):
        spec = dict(speculators())["ngram"]
        done = generate_ids(target, [Request(ids, 48, grammar=grammar, grammar_drafting=drafting)], eos,
                            speculation=spec)[0]
        rounds[drafting] = (done.round_stats.rounds, done.token_ids)
    assert rounds[True][1] == rounds[False][1] and rounds[True][0] < rounds[False][0]


def test_seeded_sampling_under_the_grammar_is_the_plain_sample(smol):
    target, tok, eos, compiler = smol
    grammar = compiler.compile(GRAMMARS["json_schema"][1])
    ids = chat_ids(tok, PROMPTS["person"])
    params = SamplingParams(temperature=0.8, seed=5)
    plain = generate_ids(target, [Request(ids, 48, params, grammar=grammar)], eos)[0]
    fast = generate_ids(target, [Request(ids, 48, params, grammar=grammar)], eos,
                        speculation=dict(speculators())["suffix"])[0]
    assert fast.token_ids == plain.token_ids
    assert isinstance(json.loads(tok.decode(plain.token_ids, skip_special_tokens=True)), dict)


def test_pruning_and_masks_follow_each_path(smol):
    """constrain(): forbidden children are cut with their subtree; each kept node's mask is the
    grammar's after the committed tokens and that node's path (a fresh state fed the path)."""
    _, tok, _, compiler = smol
    grammar = compiler.json_schema(PERSON)
    brace, quote = tok.encode("{", add_special_tokens=False)[0], tok.encode('"', add_special_tokens=False)[0]
    letter = tok.encode("x", add_special_tokens=False)[0]
    # root r; children: '{' (allowed) and 'x' (forbidden); under '{': '"' and 'x' (forbidden)
    tree = DraftTree(torch.tensor([0, brace, letter, quote, letter, quote]), torch.tensor([-1, 0, 0, 1, 1, 2]))
    state = grammar.state()
    pruned, masks = state.constrain(tree, prune=True)
    assert pruned.tokens.tolist() == [0, brace, quote] and pruned.parents.tolist() == [-1, 0, 1]
    for node, path in ((0, []), (1, [brace]), (2, [brace, quote])):
        fresh = grammar.state()
        fresh.commit(path)
        assert torch.equal(masks[node], torch.from_numpy(fresh._mask())), node
    kept, masks = grammar.state().constrain(tree, prune=False)
    assert kept is tree and masks.shape == (6, 49152) and bool(masks[2].all())  # forbidden: left free
    assert not masks[0][letter] and masks[0][brace]


def test_a_forced_chain_is_accepted_by_rejection_sampling():
    """A forced token's p is a point mass and its q too: accepted, whatever the draws."""
    vocab = 8
    tree = forced_chain(3, [5, 6], vocab, with_probs=True)
    logits = torch.full((3, vocab), float("-inf"))
    logits[0, 5] = logits[1, 6] = 0.0
    logits[2] = torch.randn(vocab)
    for seed in range(20):
        result = verify_chain(tree, logits, SamplingParams(temperature=1.0), PositionalRandom(seed).at(0))
        assert result.tokens[:2] == [5, 6] and result.num_accepted == 2


def test_bad_response_formats_are_one_line(smol):
    *_, compiler = smol
    assert compiler.compile({"type": "text"}) is None
    for bad, message in (({"type": "yaml"}, "response_format type must be"),
                         ({"type": "json_schema", "json_schema": {}}, "needs json_schema.schema"),
                         ({"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}, "cannot be used")):
        with pytest.raises(ConfigError, match=message):
            compiler.compile(bad)
