"""The tool schemas a prompt carries, for ToolSpec (toolspec.py): names, argument keys, types.

A tool-calling prompt lists its functions as JSON objects: BFCL's and our `toolcall` workload's
`{"name": ..., "description": ..., "parameters": {"type": "dict", "properties": {...},
"required": [...]}}` one a line (bench/workloads.py `toolcall_messages`), or the OpenAI / chat
template form `{"type": "function", "function": {<the same>}}`. `parse_tools(text)` finds every
such object in the prompt's text (decoded from its token ids) and keeps what a call to it can
contain: the function's name and, in the schema's order, each argument's key, its JSON type, its
enum values when it has them, and whether it is required. Anything else in the text is skipped, so
a prompt without schemas gives [] (the drafter is then the plain suffix drafter).

Worked example: the line
`{"name": "get_weather", "parameters": {"type": "dict", "properties": {"location": {"type":
"string"}, "unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["location"]}}` gives
`Tool("get_weather", (Param("location", "string", (), True), Param("unit", "string", ("c", "f"), False)))`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

MAX_TOOLS = 64  # a prompt listing more keeps its first 64 (each adds branches to the first draft)


@dataclass(frozen=True)
class Param:
    """One argument: its key, JSON type ("string", "integer", "number", "boolean", "array", "dict",
    ... as the schema spells it, lower case; "" when absent), enum values (strings), required."""

    name: str
    type: str = ""
    enum: tuple = ()
    required: bool = False


@dataclass(frozen=True)
class Tool:
    """One function: its name and its arguments in the schema's order."""

    name: str
    params: tuple[Param, ...] = ()

    def param(self, key: str) -> Param | None:
        return next((p for p in self.params if p.name == key), None)


def tool_of(obj) -> Tool | None:
    """The Tool a decoded JSON value describes, or None when it is not a function schema."""
    if not isinstance(obj, dict):
        return None
    if obj.get("type") == "function" and isinstance(obj.get("function"), dict):
        obj = obj["function"]
    name, parameters = obj.get("name"), obj.get("parameters", {})
    if not isinstance(name, str) or not name or not isinstance(parameters, dict):
        return None
    if "parameters" not in obj and "description" not in obj:
        return None  # {"name": ...} alone is a call or a record, not a schema
    properties = parameters.get("properties", {})
    required = parameters.get("required", [])
    if not isinstance(properties, dict) or not isinstance(required, list):
        return None
    params = []
    for key, spec in properties.items():
        spec = spec if isinstance(spec, dict) else {}
        kind = spec.get("type", "")
        enum = spec.get("enum", ())
        enum = tuple(v for v in enum if isinstance(v, str)) if isinstance(enum, list) else ()
        params.append(Param(str(key), kind.lower() if isinstance(kind, str) else "", enum, key in required))
    return Tool(name, tuple(params))


def parse_tools(text: str) -> list[Tool]:
    """Every function schema written as a JSON object in `text`, in order, one per name."""
    decoder = json.JSONDecoder()
    tools: dict[str, Tool] = {}
    i = text.find('{"')
    while i >= 0 and len(tools) < MAX_TOOLS:
        try:
            obj, end = decoder.raw_decode(text, i)
        except ValueError:
            i = text.find('{"', i + 1)
            continue
        tool = tool_of(obj)
        if tool is None:
            i = text.find('{"', i + 1)  # maybe a schema inside it (a list wrapper, {"tools": [...]})
            continue
        tools.setdefault(tool.name, tool)
        i = text.find('{"', end)
    return list(tools.values())
