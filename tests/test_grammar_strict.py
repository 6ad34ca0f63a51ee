"""Strict JSON schemas (issue 38 item 3): an object holds only the properties its schema names
unless the schema says otherwise (`closed_objects`, spec/grammar.py), as OpenAI's strict mode and
xgrammar's default; a schema that sets additionalProperties keeps its rule, and "strict": false
keeps the schema as written. SmolLM2 wandered on after {"city": "Paris" (the issue's tool call)
because JSON Schema's own default lets an object hold any other property."""

from __future__ import annotations

import copy

import pytest

from outrider.spec.grammar import closed_objects, tool_call_schema

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def test_an_object_without_additional_properties_is_closed():
    assert closed_objects(CITY) == {**CITY, "additionalProperties": False}
    nested = {"type": "object", "properties": {"where": CITY, "tags": {"type": "array", "items": CITY}},
              "$defs": {"Place": CITY}}
    out = closed_objects(nested)
    assert out["additionalProperties"] is False
    assert out["properties"]["where"]["additionalProperties"] is False
    assert out["properties"]["tags"]["items"]["additionalProperties"] is False
    assert out["$defs"]["Place"]["additionalProperties"] is False
    assert closed_objects({"properties": {"a": {}}})["additionalProperties"] is False  # no type: still an object
    assert closed_objects({"type": ["object", "null"]})["additionalProperties"] is False
    # a name in `required` counts as named, so the schema stays satisfiable
    assert closed_objects({"type": "object", "required": ["x"]})["properties"] == {"x": {}}


@pytest.mark.parametrize("rule", [True, {"type": "integer"}, False])
def test_a_schema_that_sets_additional_properties_keeps_its_rule(rule):
    schema = {**CITY, "additionalProperties": rule}
    out = closed_objects(schema)
    assert out["additionalProperties"] == rule
    free = closed_objects({"type": "object", "properties": {"meta": {"type": "object",
                                                                     "unevaluatedProperties": True}}})
    assert "additionalProperties" not in free["properties"]["meta"] and free["additionalProperties"] is False


def test_compositions_are_left_as_written_and_the_input_is_not_changed():
    mixed = {"type": "object", "properties": {"kind": {}}, "anyOf": [{"properties": {"x": {}}}, {"required": ["y"]}]}
    before = copy.deepcopy(mixed)
    assert closed_objects(mixed) == mixed == before  # the anyOf adds properties: closing would forbid x
    union = closed_objects({"anyOf": [CITY, {"type": "string"}]})
    assert union["anyOf"][0]["additionalProperties"] is False and union["anyOf"][1] == {"type": "string"}
    both = closed_objects({"allOf": [CITY, {"properties": {"unit": {}}}]})
    assert all("additionalProperties" not in member for member in both["allOf"])


def test_tool_calls_are_strict_unless_the_function_says_strict_false():
    strict = tool_call_schema([{"name": "get_weather", "parameters": CITY}])
    assert strict["properties"]["arguments"]["additionalProperties"] is False
    assert strict["additionalProperties"] is False  # the call itself: {"name", "arguments"} only
    loose = tool_call_schema([{"name": "get_weather", "parameters": CITY, "strict": False}])
    assert loose["properties"]["arguments"] == CITY
    none = tool_call_schema([{"name": "now"}])  # no parameters: no arguments, {}
    assert none["properties"]["arguments"] == {"type": "object", "additionalProperties": False}


@pytest.mark.model
def test_the_grammar_closes_the_object_after_the_last_named_property(smollm2_path, smollm2_tokenizer):
    """After {"city": "Paris" the strict grammar allows only the end of the object; JSON Schema's
    default (strict false, or additionalProperties true) allows a comma and another property."""
    pytest.importorskip("llguidance")
    from outrider.spec.grammar import GrammarCompiler
    from outrider.weights.tokenizer import eos_ids_of

    tok = smollm2_tokenizer
    compiler = GrammarCompiler(tok, len(tok), eos_ids_of(smollm2_path, tok))
    prefix = tok('{"city": "Paris"', add_special_tokens=False)["input_ids"]
    comma, close = tok(",")["input_ids"], tok("}")["input_ids"]
    assert len(comma) == len(close) == 1

    def allowed(grammar) -> tuple[bool, bool]:
        state = grammar.state()
        state.commit(prefix)
        mask = state._mask()
        return bool(mask[comma[0]]), bool(mask[close[0]])

    assert allowed(compiler.json_schema(CITY)) == (False, True)
    assert allowed(compiler.compile({"type": "json_schema", "json_schema": {"name": "c", "schema": CITY}})) \
        == (False, True)
    assert allowed(compiler.compile({"type": "json_schema", "json_schema": {"name": "c", "schema": CITY,
                                                                           "strict": False}})) == (True, True)
    assert allowed(compiler.json_schema({**CITY, "additionalProperties": True})) == (True, True)
    assert allowed(compiler.json_object()) == (True, True)  # json_object: any object
