"""ToolSpec (drafters/toolspec.py): the tool call's skeleton from the prompt's schemas, merged with
the suffix drafter's retrieval.

- The schema parser reads the functions of a real `toolcall` prompt (BFCL, as our workload writes
  it) in the schema's order, and the OpenAI form; a prompt without schemas gives none.
- The state machine's continuations at the call's head, after a value, in a key, for an enum.
- On the SmolLM2 tokenizer: the drafter proposes the call's head and the next key where a plain
  suffix tree cannot; a prompt without schemas gives the suffix drafter's trees, node for node.
- Greedy speculative output equals autoregressive output on tiny Llama and Qwen2 models (a
  character-level codec, so the prompt carries a schema the drafter reads) and on SmolLM2 with a
  real BFCL prompt; a seeded sampled run equals plain sampling.
- Bad options are refused in one line.
"""

import json
from pathlib import Path

import pytest
from enumerate_law import one_thread

from outrider.bench.workloads import load_workload, toolcall_messages
from outrider.drafters.suffix import SuffixDrafter
from outrider.drafters.toolspec import Codec, ToolSpecDrafter, parse_argument
from outrider.drafters.toolspec_fsm import CallState
from outrider.drafters.toolspec_schema import Param, parse_tools
from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.errors import ConfigError
from outrider.sampling import SamplingParams
from outrider.spec.types import Budget, VerifyResult
from outrider.weights.loader import load_decoder

FIXTURES = Path(__file__).parent / "fixtures"
WEATHER = ('{"name": "get_weather", "description": "d", "parameters": {"type": "dict", "properties": '
           '{"city": {"type": "string"}, "days": {"type": "integer"}, "unit": {"type": "string", '
           '"enum": ["c", "f"]}}, "required": ["city", "days"]}}')


def chat(messages) -> str:
    """The tiny models' chat template (tests/tiny.py CHAT_TEMPLATE), written out."""
    turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return turns + "<|im_start|>assistant\n"


def entry(name: str, i: int = 0) -> dict:
    return [json.loads(line) for line in (FIXTURES / name).read_text().splitlines() if line.strip()][i]


# -- the schemas ---------------------------------------------------------------------------------
def test_the_parser_reads_the_toolcall_workloads_prompts():
    workload = load_workload("toolcall", limit=3, fixtures=FIXTURES)
    for prompt in workload.prompts:
        text = chat(prompt.messages)
        tools = parse_tools(text)
        category = {"simple": "BFCL_v4_simple_python.json", "multiple": "BFCL_v4_multiple.json",
                    "live": "BFCL_v4_live_simple.json"}[prompt.id.split("_")[0]]
        source = next(e for e in map(json.loads, (FIXTURES / category).read_text().splitlines())
                      if e["id"] == prompt.id)
        assert [t.name for t in tools] == [f["name"] for f in source["function"]]
        for tool, function in zip(tools, source["function"]):
            properties = function["parameters"]["properties"]
            assert [p.name for p in tool.params] == list(properties)  # the schema's order
            assert [p.required for p in tool.params] == [k in function["parameters"].get("required", [])
                                                         for k in properties]
            assert [p.type for p in tool.params] == [v["type"] for v in properties.values()]
    live = parse_tools(chat(toolcall_messages(entry("BFCL_v4_live_simple.json", 2))))  # uber.ride
    assert live[0].param("type") == Param("type", "string", ("plus", "comfort", "black"), True)


def test_the_parser_takes_the_openai_form_and_nothing_else():
    wrapped = json.dumps({"type": "function", "function": json.loads(WEATHER)})
    assert [t.name for t in parse_tools(f"tools: [{wrapped}]")] == ["get_weather"]
    assert parse_tools("no tools here {\"a\": 1} and a call {\"name\": \"f\", \"arguments\": {}}") == []
    assert parse_tools("") == [] and parse_tools("{\"name\": broken") == []


# -- the state machine ----------------------------------------------------------------------------
def alts(text: str) -> list[tuple[str, float, bool]]:
    state = CallState(parse_tools(WEATHER))
    state.feed(text)
    return [(a.text, round(a.share, 3), a.end) for a in state.continuations()]


def test_the_state_machine_follows_the_call():
    head = '{"name": "get_weather", "arguments": {"city": "'
    assert alts("") == [(head, 1.0, False)]
    assert alts('{"name": "get_w') == [(head[len('{"name": "get_w'):], 1.0, False)]
    # after a value: the next key in the schema's order first (a number's space, a string's quote)
    assert alts(head + 'Paris",') == [(' "days": ', 0.5, False), (' "unit": "', 0.5, False)]
    assert alts(head + 'Paris", "d') == [('ays": ', 1.0, False)]
    assert alts(head + 'Paris", "days": 3') == [(', "unit": "', 0.25, False), ("}}", 0.25, True)]  # or more digits
    assert alts(head + 'Paris", "days": 3, "unit": "') == [('c"}}', 0.5, True), ('f"}}', 0.5, True)]  # an enum
    assert alts(head + 'Paris", "days": 3, "unit": "c"') == [("}}", 1.0, True)]
    assert alts(head + 'Paris", "days": 3, "unit": "c"}}') == [("", 1.0, True)]  # then the turn ends
    assert alts(head + 'Par') == [('", "days": ', 0.225, False), ('"}}', 0.075, True)]  # a free string may end
    assert alts("```json\n") == [(head, 1.0, False)]
    assert alts("I will call get_weather.") == []  # prose: nothing


# -- the drafter, on a real tokenizer -------------------------------------------------------------
def tree_paths(tree) -> set:
    out = set()
    for i in range(1, tree.size):
        path, j = [], i
        while j > 0:
            path.append(int(tree.tokens[j]))
            j = int(tree.parents[j])
        out.add(tuple(reversed(path)))
    return out


@pytest.fixture(scope="module")
def codec(smollm2_tokenizer):
    return Codec(smollm2_tokenizer)


def triangle_prompt(tokenizer) -> list[int]:
    messages = toolcall_messages(entry("BFCL_v4_simple_python.json", 0))  # calculate_triangle_area(base, height, unit)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False).input_ids


@pytest.mark.model
def test_the_drafter_proposes_what_a_suffix_tree_cannot(smollm2_tokenizer, codec):
    prompt = triangle_prompt(smollm2_tokenizer)
    ours, suffix = ToolSpecDrafter(codec, (smollm2_tokenizer.eos_token_id,)), SuffixDrafter()
    for d in (ours, suffix):
        d.start(0, prompt)
    head = codec.encode('{"name": "calculate_triangle_area", "arguments": {"base":')[:6]
    assert tuple(head) in tree_paths(ours.propose(0, prompt, Budget(6, 12)))  # the call's head, first round
    assert tuple(head) not in tree_paths(suffix.propose(0, prompt, Budget(6, 12)))
    out = codec.encode('{"name": "calculate_triangle_area", "arguments": {"base": 10,')
    tokens = prompt + out
    for d in (ours, suffix):
        d.update(0, VerifyResult(accepted_nodes=[], tokens=out))
    nxt = tuple(ours.in_context(tokens, ' "height": '))  # the next key, and the space before its number
    assert codec.decode(list(nxt)) == ' "height": '
    assert nxt in tree_paths(ours.propose(0, tokens, Budget(6, 12)))
    assert nxt not in tree_paths(suffix.propose(0, tokens, Budget(6, 12)))
    assert ours.stats()["requests_with_tools"] == 1 and ours.stats()["schema_drafted"] > 0


@pytest.mark.model
def test_a_prompt_without_schemas_is_the_suffix_drafter(smollm2_tokenizer, codec):
    text = "def f(x):\n    return x + 1\n\ndef g(x):\n    return f(x) + f(x)\n" * 3
    prompt = smollm2_tokenizer(text).input_ids
    ours, suffix = ToolSpecDrafter(codec), SuffixDrafter()
    for d in (ours, suffix):
        d.start(0, prompt)
    tokens = list(prompt)
    for step in smollm2_tokenizer("def h(x):\n    return f(x) + g(x)\n").input_ids:
        a, b = ours.propose(0, tokens, Budget(6, 12)), suffix.propose(0, tokens, Budget(6, 12))
        assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()
        for d in (ours, suffix):
            d.update(0, VerifyResult(accepted_nodes=[], tokens=[step]))
        tokens.append(step)
    assert ours.stats()["requests_with_tools"] == 0


# -- exact: greedy output equals autoregressive output ---------------------------------------------
class Chars:
    """A character-level codec over the tiny models' 96 ids: printable ASCII and newline."""

    def encode(self, text: str) -> list[int]:
        return [95 if c == "\n" else ord(c) - 31 for c in text if c == "\n" or 32 <= ord(c) < 127]

    def decode(self, ids) -> str:
        return "".join("\n" if i == 95 else chr(i + 31) if 1 <= i < 95 else "?" for i in ids)


SHORT = '{"name": "wx", "parameters": {"properties": {"city": {"type": "string"}, "n": {"type": "integer"}}}}'
TINY_PROMPTS = [Chars().encode(SHORT + '\nweather in Paris, 3 days\n{"name": "w'), Chars().encode(SHORT + "\n"),
                [3, 4, 5, 3, 4, 5, 3]]  # the tiny models hold 256 positions


def generate(target, spec, n=24, params=None):
    requests = [Request(list(p), n, params or SamplingParams()) for p in TINY_PROMPTS]
    with one_thread():
        return [f.token_ids for f in generate_ids(target, requests, set(), speculation=spec)]


@pytest.mark.parametrize("family, option", [("llama", "toolspec"), ("qwen2", "toolspec"),
                                            ("llama", "toolspec:retrieval=off")])
def test_greedy_output_is_autoregressive(tiny_folders, family, option):
    folder = tiny_folders[family]
    target = load_decoder(folder, "cpu")
    spec = Speculator.build(SpecOptions(option, "chain", "fixed:4"), target, folder)
    spec.drafter.codec, spec.drafter.end_ids = Chars(), (2,)
    assert generate(target, spec) == generate(target, None)
    stats = spec.drafter.stats()
    assert stats["requests_with_tools"] == 2 and stats["schema_drafted"] > 0  # the schema drafted


def test_seeded_sampling_equals_plain_sampling(tiny_folders):
    folder = tiny_folders["llama"]
    target = load_decoder(folder, "cpu")
    spec = Speculator.build(SpecOptions("toolspec", "chain", "fixed:4"), target, folder)
    spec.drafter.codec = Chars()
    params = SamplingParams(temperature=0.8, seed=17)
    assert generate(target, spec, 20, params) == generate(target, None, 20, params)


@pytest.mark.model
def test_smollm2_greedy_output_is_autoregressive(smollm2_decoder, smollm2_path, smollm2_tokenizer):
    prompt = triangle_prompt(smollm2_tokenizer)  # SmolLM2 answers this one in prose: the call's head is refused
    eos = {smollm2_tokenizer.eos_token_id}
    spec = Speculator.build(SpecOptions("toolspec", "chain", "fixed:6"), smollm2_decoder, smollm2_path)
    with one_thread():
        ar = generate_ids(smollm2_decoder, [Request(list(prompt), 16)], eos)[0].token_ids
        ours = generate_ids(smollm2_decoder, [Request(list(prompt), 16)], eos, speculation=spec)[0]
    assert ours.token_ids == ar
    assert spec.drafter.stats()["tools_parsed"] == 1 and spec.drafter.stats()["schema_drafted"] > 0


# -- options ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, why", [
    ("toolspec:foo", "the only option is retrieval=on|off"),
    ("toolspec:retrieval=maybe", "retrieval='maybe'"),
    ("toolspec:retrieval=on,retrieval=off", "given twice"),
])
def test_bad_options_are_refused_in_one_line(text, why):
    with pytest.raises(ConfigError) as err:
        SpecOptions(text).check()
    assert str(err.value).startswith(f"--drafter '{text}': ") and why in str(err.value)
    assert "\n" not in str(err.value)


def test_options_parse():
    assert parse_argument("") is True and parse_argument("retrieval=off") is False
    assert parse_argument("retrieval=on") is True
