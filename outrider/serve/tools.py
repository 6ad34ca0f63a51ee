"""Structured outputs and tool calls on the server (issue 25 item 3).

In: `response_format` (both routes) and `tools` / `tool_choice` (chat) are checked here, field by
field, for protocol.py; messages of role "tool" and assistant messages with `tool_calls` too.
Each becomes one grammar (spec/grammar.py, llguidance): the response format's JSON schema, or
one call {"name", "arguments"} of one of the tools (tool_choice "required") or of the named one
(`tool_call_schema`). The engine masks the target's distribution with it in plain decoding and
in verification alike, so greedy speculative output equals greedy plain output and the output
parses when it finishes.

tool_choice "auto" (OpenAI's default when tools are given) is refused as vLLM refuses it
without --enable-auto-tool-choice and --tool-call-parser: this server has no parser to tell a
call from text. One call is produced per choice (`parallel_tool_calls` is accepted).

The model sees the tools: through its chat template (`tools=`) when the template renders them,
else in a system message in the toolcall workload's house format (bench/workloads.py
TOOLCALL_SYSTEM), with earlier calls written into the assistant's text the same way.

Out: a choice whose text parses as a call of one of the tools becomes OpenAI's
`message.tool_calls` (streamed: one `delta.tool_calls` when the call is complete) with
finish_reason "tool_calls"; one that does not (cut by max_tokens) keeps its text as content and
its own finish_reason.
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from collections import OrderedDict

from .errors import ApiError, bad, show
from .responses import choice, chunk

AUTO = ('"auto" tool choice (OpenAI\'s default when tools are given) requires --enable-auto-tool-choice and '
        '--tool-call-parser to be set in vLLM, and this server has no tool-call parser: send tool_choice '
        '"required" or {"type": "function", "function": {"name": NAME}} for one call, or "none"')
NO_TOOLS = ('tool_choice needs tools ("When using `tool_choice`, `tools` must be set", as vLLM says): send tools '
            'or leave tool_choice out')
CACHED_GRAMMARS = 256


# -- checking the request ------------------------------------------------------------------------
def response_format(value) -> dict | None:
    """OpenAI's response_format: None for text (no grammar), else what GrammarCompiler.compile takes."""
    p = "response_format"
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise bad('response_format must be an object {"type": "text" | "json_object" | "json_schema"}', p)
    kind = value["type"]
    fields = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}.get(kind)
    if fields is None:
        raise bad(f'response_format.type must be "text", "json_object" or "json_schema", got {show(kind)}', p)
    _known(value, fields, f"response_format of type {kind}", p)
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise bad('response_format of type json_schema needs "json_schema": {"name", "schema", "strict"?, '
                  '"description"?}', p)
    _known(spec, {"name", "schema", "strict", "description"}, "response_format.json_schema", p)
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise bad("response_format.json_schema.name must be a non-empty string (OpenAI requires it)", p)
    if not isinstance(spec.get("schema"), dict):
        raise bad("response_format.json_schema.schema must be a JSON schema object", p)
    _optional(spec, "strict", bool, "true or false", p, "response_format.json_schema.")
    _optional(spec, "description", str, "a string", p, "response_format.json_schema.")
    out = {"name": spec["name"], "schema": spec["schema"]}
    if spec.get("strict") is False:  # the schema as written: objects open where it does not close them
        out["strict"] = False
    return {"type": "json_schema", "json_schema": out}


def tools_and_choice(tools, tool_choice) -> tuple[list[dict] | None, bool, str | None]:
    """(the function objects offered to the model, whether one call is made, the named function).
    tool_choice "none" offers nothing and makes no call."""
    functions = _tools(tools)
    if tool_choice is None:
        if functions:
            raise bad(AUTO, "tool_choice")
        return None, False, None
    if tool_choice == "none":
        return None, False, None
    if functions is None and (tool_choice in ("auto", "required") or isinstance(tool_choice, dict)):
        raise bad(NO_TOOLS, "tool_choice")
    if tool_choice == "auto":
        raise bad(AUTO, "tool_choice")
    if tool_choice == "required":
        return functions, True, None
    usage = '{"type": "function", "function": {"name": NAME}}'
    if not isinstance(tool_choice, dict):
        raise bad(f'tool_choice must be "none", "required" or {usage}, got {show(tool_choice)}', "tool_choice")
    _known(tool_choice, {"type", "function"}, "tool_choice", "tool_choice")
    function = tool_choice.get("function")
    if tool_choice.get("type") != "function" or not isinstance(function, dict) or set(function) != {"name"} \
            or not isinstance(function["name"], str):
        raise bad(f"a named tool_choice must be {usage}", "tool_choice")
    names = [f["name"] for f in functions]
    if function["name"] not in names:
        raise bad(f"tool_choice names the function {show(function['name'])}, which is not among the tools "
                  f"({', '.join(names)}): name one of them", "tool_choice")
    return functions, True, function["name"]


def _tools(tools) -> list[dict] | None:
    p = "tools"
    if tools is None:
        return None
    if not isinstance(tools, list) or not tools:
        raise bad("tools must be a non-empty list of {\"type\": \"function\", \"function\": {...}} (as vLLM and "
                  "OpenAI: leave tools out rather than send [])", p)
    out, seen = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad(f'{where} must be {{"type": "function", "function": {{"name", "description"?, '
                      '"parameters"?}}}: function tools only', p)
        _known(tool, {"type", "function"}, where, p)
        function = tool.get("function")
        if not isinstance(function, dict):
            raise bad(f'{where}.function must be an object {{"name", "description"?, "parameters"?}}', p)
        _known(function, {"name", "description", "parameters", "strict"}, f"{where}.function", p)
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise bad(f"{where}.function.name must be a non-empty string", p)
        if name in seen:
            raise bad(f"tools name the function {show(name)} twice: give each function once", p)
        seen.add(name)
        _optional(function, "description", str, "a string", p, f"{where}.function.")
        _optional(function, "parameters", dict, "a JSON schema object", p, f"{where}.function.")
        _optional(function, "strict", bool, "true or false", p, f"{where}.function.")
        out.append({k: function[k] for k in ("name", "description", "parameters") if function.get(k) is not None})
        if function.get("strict") is False:  # its arguments as its parameters say, objects open by default
            out[-1]["strict"] = False
    return out


def tool_message(i: int, m: dict, content: str) -> dict:
    """A message of role "tool": its content and the id of the call it answers."""
    _known(m, {"role", "content", "tool_call_id"}, f"messages[{i}] (role tool)", "messages")
    if not isinstance(m.get("tool_call_id"), str):
        raise bad(f"messages[{i}].tool_call_id must be a string: the id of the call this result answers", "messages")
    return {"role": "tool", "content": content, "tool_call_id": m["tool_call_id"]}


def assistant_calls(i: int, calls) -> list[dict]:
    """An assistant message's earlier tool calls, as OpenAI writes them."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise bad(f"{where} must be a list of calls", "messages")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(call, dict) and set(call) == {"id", "type", "function"} and isinstance(call["id"], str)
                and call["type"] == "function" and isinstance(function, dict)
                and set(function) == {"name", "arguments"} and isinstance(function["name"], str)
                and isinstance(function["arguments"], str)):
            raise bad(f'{where}[{j}] must be {{"id": string, "type": "function", "function": {{"name": string, '
                      '"arguments": JSON string}}}}', "messages")
        out.append({"id": call["id"], "type": "function",
                    "function": {"name": function["name"], "arguments": function["arguments"]}})
    return out


def _known(value: dict, fields: set, where: str, param: str) -> None:
    unknown = set(value) - fields
    if unknown:
        raise bad(f"{where} has unknown field(s) {sorted(unknown)}: {', '.join(sorted(fields))} are known", param)


def _optional(value: dict, key: str, kind: type, what: str, param: str, prefix: str) -> None:
    v = value.get(key)
    if v is not None and (not isinstance(v, kind) or (kind is not bool and isinstance(v, bool))):
        raise bad(f"{prefix}{key} must be {what}, got {show(v)}", param)


# -- the prompt ------------------------------------------------------------------------------------
PROBE = [{"type": "function", "function": {"name": "outrider_probe_fn", "description": "a probe",
                                           "parameters": {"type": "object", "properties": {}}}}]


def template_renders_tools(tokenizer) -> bool:
    """Whether the chat template shows the model the `tools` it is given (SmolLM2's does not)."""
    user = [{"role": "user", "content": "x"}]
    try:
        text = tokenizer.apply_chat_template(user, tools=PROBE, add_generation_prompt=True, tokenize=False)
    except Exception:  # a template that refuses tools
        return False
    return "outrider_probe_fn" in text


def template_input(messages: list[dict], functions: list[dict] | None, native: bool) -> tuple[list[dict], dict]:
    """(messages, apply_chat_template keywords): the tools through the template when it renders
    them (`native`), else in a house-format system message, with earlier calls in the text."""
    if native:
        out = []
        for m in messages:
            if "tool_calls" in m:  # templates read the arguments as an object (vLLM parses them too)
                calls = [{**c, "function": {**c["function"], "arguments": _loads(c["function"]["arguments"])}}
                         for c in m["tool_calls"]]
                m = {**m, "content": m["content"] or "", "tool_calls": calls}
            out.append(m)
        return out, ({"tools": [{"type": "function", "function": _shown(f)} for f in functions]} if functions else {})
    out = []
    for m in messages:
        if "tool_calls" in m:
            calls = [json.dumps({"name": c["function"]["name"], "arguments": _loads(c["function"]["arguments"])},
                                ensure_ascii=False) for c in m["tool_calls"]]
            m = {"role": "assistant", "content": "\n".join(([m["content"]] if m["content"] else []) + calls)}
        elif m["role"] == "tool":
            m = {"role": "tool", "content": m["content"]}
        out.append(m)
    if functions:
        from ..bench.workloads import TOOLCALL_SYSTEM

        system = TOOLCALL_SYSTEM.format(functions="\n".join(json.dumps(_shown(f), ensure_ascii=False)
                                                             for f in functions))
        if out and out[0]["role"] == "system":  # the client's own system message goes first in ours
            system = out.pop(0)["content"].strip() + "\n\n" + system
        out.insert(0, {"role": "system", "content": system})
    return out, {}


def _shown(function: dict) -> dict:
    """What the model is shown of a function: its name, description and parameters."""
    return {k: v for k, v in function.items() if k != "strict"}


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


# -- the grammar -----------------------------------------------------------------------------------
class Structured:
    """One server's grammars: the compiler (built on first use, about a second, off the event
    loop), compiled grammars by schema (the same tools come back request after request), and
    whether the chat template renders tools."""

    def __init__(self, llm, tokenizer_lock: threading.Lock):
        self.llm, self.tokenizer_lock = llm, tokenizer_lock
        self._lock = threading.Lock()
        self._compiler = None
        self._unavailable: str | None = None
        self._grammars: OrderedDict[str, object] = OrderedDict()
        self._native: bool | None = None

    def native_tools(self) -> bool:
        """Call with the tokenizer lock held."""
        if self._native is None:
            self._native = template_renders_tools(self.llm.tokenizer)
        return self._native

    async def grammar(self, parsed):
        """The request's grammar (None: none), compiled in a worker thread; a schema llguidance
        cannot use is a 400 naming its field, with llguidance's one-line reason."""
        if parsed.tool_call:
            from ..spec.grammar import tool_call_schema

            spec, param = {"type": "json_schema", "json_schema": {  # strict per function: closed already
                "schema": tool_call_schema(parsed.tools, parsed.tool_name), "strict": False}}, "tools"
        elif parsed.response_format is not None:
            spec, param = parsed.response_format, "response_format"
        else:
            return None
        return await asyncio.to_thread(self._compile, spec, param)

    def _compile(self, spec: dict, param: str):
        key = json.dumps(spec, sort_keys=True)
        with self._lock:
            if self._compiler is None and self._unavailable is None:
                try:
                    with self.tokenizer_lock:
                        self._compiler = self.llm.grammars()
                except Exception as err:  # llguidance missing, or a tokenizer it cannot read
                    self._unavailable = str(err).splitlines()[0] if str(err) else type(err).__name__
            if self._unavailable is not None:
                raise ApiError(400, f"{param} cannot be honoured: structured outputs are not available for this "
                                    f"model ({self._unavailable}): leave {param} out", param,
                               code="structured_outputs_unavailable")
            grammar = self._grammars.get(key)
            if grammar is not None:
                self._grammars.move_to_end(key)
                return grammar
        try:
            grammar = self._compiler.compile(spec)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as err:  # ConfigError with llguidance's reason (or a panic of its own)
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            what = "the tools' parameters" if param == "tools" else "the schema"
            raise bad(f"{param}: {reason} (llguidance): fix {what}", param) from None
        with self._lock:
            self._grammars[key] = grammar
            while len(self._grammars) > CACHED_GRAMMARS:
                self._grammars.popitem(last=False)
        return grammar


# -- the answer ------------------------------------------------------------------------------------
def tool_call(text: str | None, parsed) -> dict | None:
    """OpenAI's tool call from an output {"name", "arguments"}; None when it does not parse."""
    try:
        call = json.loads(text or "")
    except ValueError:
        return None
    names = [f["name"] for f in parsed.tools or ()]
    if not (isinstance(call, dict) and set(call) == {"name", "arguments"} and call["name"] in names
            and parsed.tool_name in (None, call["name"])):
        return None
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)}}


def answer(parsed, index: int, chat: bool, text: str, reason: str | None, logprobs: dict | None) -> dict:
    """A whole response's choice: a tool call, or the text."""
    call = tool_call(text, parsed) if chat and parsed.tool_call else None
    if call is None:
        return choice(index, chat, text, reason, logprobs)
    return {"index": index, "message": {"role": "assistant", "content": None, "tool_calls": [call]},
            "logprobs": logprobs, "finish_reason": "tool_calls"}


def stream_end(parsed, rid: str, model: str, index: int, completion, logprobs: dict | None, use: dict | None,
               ext: dict) -> list[dict]:
    """A streamed tool-call choice's end (its text was held back until now): the call in one
    delta, then the finish chunk; or, when the text is not a call, the text and its finish."""
    call = tool_call(completion.text, parsed)
    if call is None:
        head = [chunk(rid, model, True, index, completion.text, logprobs=logprobs, use=use)] \
            if completion.text or logprobs else []
        return head + [chunk(rid, model, True, index, None, completion.finish_reason, use=use, ext=ext)]
    delta = {"tool_calls": [{"index": 0, **call}]}
    return [chunk(rid, model, True, index, None, delta=delta, logprobs=logprobs, use=use),
            chunk(rid, model, True, index, None, "tool_calls", use=use, ext=ext)]
