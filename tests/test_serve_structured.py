"""Structured outputs and tool calls through `outrider serve` (issue 25 item 3): response_format
(json_object, json_schema) on both routes and tools with tool_choice "required" or a named
function on chat, on the packaged SmolLM2 with a drafter: greedy speculative output equals the
same request without drafts (and without grammar-aware drafting), the output parses, tool calls
come in OpenAI's shape (whole and streamed) with arguments that fit the function's schema; what
is refused ("auto", unknown names, bad schemas) is a one-line 400 naming the field. One server
for the module: a SmolLM2 load costs seconds."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytest.importorskip("llguidance")

from outrider.serve import tools  # noqa: E402
from outrider.serve.protocol import parse_chat  # noqa: E402
from outrider.serve.schema import ChatCompletionChunk, ChatCompletionResponse, CompletionResponse  # noqa: E402
from test_serve_api import LiveServer  # noqa: E402

pytestmark = pytest.mark.model

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"}},
          "required": ["name", "age", "city"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Oslo in celsius? Call the tool."}]
CALL_ID = re.compile(r"^call_[0-9a-f]{24}$")


@pytest.fixture(scope="module")
def server(smollm2_path):
    srv = LiveServer(smollm2_path, drafter="ngram", controller="fixed:4", max_running=4, max_model_len=1024)
    yield srv
    srv.close()


def post(srv, body: dict, chat: bool = True) -> httpx.Response:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return httpx.post(srv.url + path, json={"temperature": 0, **body}, timeout=120)


def events(srv, body: dict) -> list[dict]:
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json={"temperature": 0, "stream": True, **body},
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def together(*calls):
    """Run the calls at once (the server batches them; each greedy output is what it is alone)."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(call) for call in calls]]


def refused(r: httpx.Response, param: str) -> str:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "\n" not in error["message"], error
    return error["message"]


def fits(arguments: dict, schema: dict) -> bool:
    import jsonschema_rs

    return jsonschema_rs.validator_for(schema).is_valid(arguments)


# -- response_format ------------------------------------------------------------------------------
@pytest.mark.parametrize("chat, body", [
    (True, {"messages": [{"role": "user", "content": "Describe Alice, 30, from Paris, as JSON."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                       "strict": True}}}),
    (True, {"messages": [{"role": "user", "content": "Reply with a JSON object with one key, ok, set to true."}],
            "response_format": {"type": "json_object"}}),
    (False, {"prompt": "A JSON object describing a cat:", "response_format": {"type": "json_object"},
             "max_tokens": 16}),
], ids=["chat-json_schema", "chat-json_object", "completions-json_object"])
def test_response_format_is_exact_with_a_drafter_and_parses(server, chat, body):
    body = {"max_tokens": 48, **body}
    json_schema = chat and "json_schema" in json.dumps(body)
    fast, plain, unaware = together(lambda: post(server, body, chat),
                                    lambda: post(server, {**body, "speculate": False}, chat),
                                    lambda: post(server, {**body, "grammar_drafting": False}, chat) if json_schema
                                    else None)
    assert fast.status_code == plain.status_code == 200, fast.text
    model = ChatCompletionResponse if chat else CompletionResponse
    out, ref = model.model_validate_json(fast.content).choices[0], model.model_validate_json(plain.content).choices[0]
    text = out.message.content if chat else out.text
    assert text == (ref.message.content if chat else ref.text) and out.finish_reason == ref.finish_reason
    if out.finish_reason == "stop":  # finished: it parses (a length cut may not)
        value = json.loads(text)
        assert isinstance(value, dict)
        if json_schema:
            assert fits(value, PERSON)
    if json_schema:
        assert out.finish_reason == "stop"
        assert unaware.json()["choices"][0]["message"]["content"] == text
        assert fast.json()["outrider"]["drafted"] > 0


# -- tool calls ------------------------------------------------------------------------------------
def test_required_tool_call_with_the_openai_client(server):
    client = server.client()
    out = client.chat.completions.create(model=server.name, messages=ASK, tools=[TIME, WEATHER],
                                         tool_choice="required", max_tokens=48, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert CALL_ID.match(call.id) and call.type == "function"
    function = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]
    assert fits(json.loads(call.function.arguments), function["parameters"])


CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}  # no additionalProperties


def test_arguments_and_json_schema_outputs_are_strict_by_default(server):
    """Issue 38: a function whose parameters name only `city` (additionalProperties unset). Under
    JSON Schema's default SmolLM2 went on after "Paris" with "type", "properties", ... until
    max_tokens (no tool call); strict, the grammar closes the object: one get_weather call with a
    city argument and nothing else, speculative equal to plain. The same for a json_schema."""
    tool = {"type": "function", "function": {"name": "get_weather", "description": "Get the weather",
                                             "parameters": CITY}}
    call = {"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "tools": [tool],
            "tool_choice": "required", "max_tokens": 48}
    answer = {"messages": [{"role": "user", "content": "Which city is the capital of France? Answer in JSON."}],
              "response_format": {"type": "json_schema", "json_schema": {"name": "place", "schema": CITY}},
              "max_tokens": 48}
    fast, plain, fast_json, plain_json = together(
        lambda: post(server, call), lambda: post(server, {**call, "speculate": False}),
        lambda: post(server, answer), lambda: post(server, {**answer, "speculate": False}))
    calls = []
    for r in (fast, plain):
        choice = ChatCompletionResponse.model_validate_json(r.content).choices[0]
        assert choice.finish_reason == "tool_calls", r.text
        (one,) = choice.message.tool_calls
        arguments = json.loads(one.function.arguments)
        assert one.function.name == "get_weather" and set(arguments) == {"city"}, r.text
        calls.append(arguments)
    assert calls[0] == calls[1] and calls[0]["city"] == "Paris"
    texts = [ChatCompletionResponse.model_validate_json(r.content).choices[0] for r in (fast_json, plain_json)]
    assert texts[0] == texts[1] and texts[0].finish_reason == "stop"
    assert set(json.loads(texts[0].message.content)) == {"city"}


def test_named_tool_call_whole_and_streamed(server):
    body = {"messages": ASK, "tools": [WEATHER, TIME], "max_tokens": 48,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    r, streamed_events = together(lambda: post(server, body), lambda: events(server, body))
    assert r.status_code == 200, r.text
    whole = ChatCompletionResponse.model_validate_json(r.content).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_weather" and CALL_ID.match(call.id)
    arguments = json.loads(call.function.arguments)
    assert fits(arguments, WEATHER["function"]["parameters"]) and arguments["city"] == "Oslo"
    chunks = [ChatCompletionChunk.model_validate(e) for e in streamed_events]
    deltas = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(deltas) == 1 and not any(c.choices[0].delta.content for c in chunks)
    (streamed,) = deltas[0].tool_calls
    assert streamed.index == 0 and CALL_ID.match(streamed.id) and streamed.type == "function"
    assert (streamed.function.name, streamed.function.arguments) == ("get_weather", call.function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_call_cut_by_max_tokens_is_text_with_finish_length(server):
    body = {"messages": ASK, "tools": [WEATHER], "tool_choice": "required", "max_tokens": 4}
    r, chunks = together(lambda: post(server, body), lambda: events(server, body))
    whole = r.json()["choices"][0]
    assert whole["finish_reason"] == "length" and "tool_calls" not in whole["message"]
    assert whole["message"]["content"].startswith("{")
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == whole["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_a_multi_turn_tool_conversation_is_rendered_and_answered(server):
    """An assistant's earlier call and the tool's result: SmolLM2's template renders neither
    tools nor calls, so the tools go into the house system message and the call into the text."""
    call = {"id": "call_" + "a" * 24, "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": call["id"], "content": '{"temperature": 21}'}]
    body = {"messages": messages, "tools": [WEATHER], "tool_choice": "none", "max_tokens": 6}
    assert post(server, body).status_code == 200
    state = server.state
    assert not state.structured.native_tools()  # SmolLM2's template ignores tools
    text = state.llm.tokenizer.decode(state.encode(parse_chat({**body, "tool_choice": "required"}, state.vocab))[0])
    assert text.count("Answer the user's request with exactly one function call") == 1
    assert '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}' in text
    assert "<|im_start|>tool\n{\"temperature\": 21}" in text
    plain = state.llm.tokenizer.decode(state.encode(parse_chat(body, state.vocab))[0])
    assert "exactly one function call" not in plain  # tool_choice none: the tools are not offered


def test_a_template_that_renders_tools_gets_them(tiny_folders):
    """A template that renders `tools` gets the tools and the earlier calls (arguments as
    objects, as vLLM hands them), and no house system message."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_folders["llama"]))
    assert not tools.template_renders_tools(tok)
    tok.chat_template = ("{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}"
                         "{{ m.role }}:{{ m.content }}{% for c in m.tool_calls or [] %}<{{ c.function.name }} "
                         "{{ c.function.arguments.city }}>{% endfor %};{% endfor %}")
    assert tools.template_renders_tools(tok)
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = [{"role": "user", "content": "w5"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": "21", "tool_call_id": "c1"}]
    out, extra = tools.template_input(messages, [WEATHER["function"]], native=True)
    text = tok.apply_chat_template(out, tokenize=False, **extra)
    assert text == "[get_weather]user:w5;assistant:<get_weather Oslo>;tool:21;"


# -- refusals --------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra, param, says", [
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice", "--enable-auto-tool-choice"),
    ({"tools": [WEATHER]}, "tool_choice", '"auto" tool choice'),  # OpenAI's default with tools
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not among the tools"),
    ({"tool_choice": "required"}, "tool_choice", "`tools` must be set"),
    ({"tools": [], "tool_choice": "none"}, "tools", "non-empty"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}], "tool_choice": "required"},
     "tools", "name"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools", "twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "integer", "minimum": 3,
                                                                              "maximum": 1}}}],
      "tool_choice": "required"}, "tools", "llguidance"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format", "Invalid type: foo"),
    ({"response_format": {"type": "regex"}}, "response_format", "json_object"),
    ({"response_format": {"type": "json_object"}, "tools": [WEATHER], "tool_choice": "required"},
     "response_format", "tool call"),
    ({"messages": [{"role": "tool", "content": "21"}]}, "messages", "tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "x", "function": {"name": "f"}}]}]}, "messages",
     "tool_calls[0]"),
])
def test_refusals_are_one_line_400s_naming_the_field(server, extra, param, says):
    message = refused(post(server, {"messages": ASK, "max_tokens": 4, **extra}), param)
    assert says in message, message
