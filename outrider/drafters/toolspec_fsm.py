"""ToolSpec's finite-state machine: where the output is inside a JSON tool call, and what the
schema says comes next.

The call the model is asked for (bench/workloads.py TOOLCALL_SYSTEM, and the usual chat-template
form) is one JSON object:

    {"name": "get_weather", "arguments": {"location": "Paris", "unit": "c"}}

Its skeleton is fixed by the schemas (toolspec_schema.py): the keys "name" and "arguments", one of
the function names, that function's argument keys (in the schema's order), the punctuation, and,
for an enum or a boolean, the value itself. The values of the other arguments are the variable
fields: the machine proposes only how they begin (` "` for a string, ` ` before a number, ` [`
for an array) and leaves them to retrieval (the suffix drafter, merged in toolspec.py).

`CallState.feed(text)` reads the output's text as it is committed, one character at a time (a
JSON lexer: strings with escapes, scalars, nested objects and arrays, which keys each object has
written). `CallState.continuations()` then gives the skeleton's next text from there, as
alternatives with shares (summing to at most 1), each perhaps ending the call (`end`: the drafter
adds the end-of-turn token after it). With the schema above (`location` required, `unit` an enum
of "c" and "f"):

    output so far                              continuations (share)
    ""                                         '{"name": "get_weather", "arguments": {"location": "' (1)
    '{"name": "get_w'                          'eather", "arguments": {"location": "' (1)
    '... {"location": "Paris",'                ' "unit": "' (1)
    '... "unit": "'                            'c"}}' + end (0.5), 'f"}}' + end (0.5)
    '... {"location": "Par'                    '", "unit": "' (0.15), '"}}' + end (0.15)

While the head is written (through the first key) the text so far is matched against each
function's head, so a prefix shared by several functions branches. After a value: the next
unwritten key in the schema's order (keys after the last one written first; 0.75 while a required
key is unwritten, else 0.5) or the closing braces. A free string value or a number may end after
any token (shares STRING_END and SCALAR_END): retrieval proposes the value itself. A call written
another way (keys in another order, other spacing) is still read right, since the lexer follows
what was written; only the proposals assume the prompt's spacing. Text before the call is skipped
(a "```json" fence: the call's end is then followed by the closing fence, not the end of turn);
only the output's first call gets its head proposed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .toolspec_schema import Param, Tool

NEXT_KEY = 0.75  # the share of "another argument follows" after a value while a required one is unwritten
SCALAR_END = 0.5  # the share of "the number ends here" after each of its characters
STRING_END = 0.3  # the share of "the string value ends here" after each of its tokens
SCALAR = set("0123456789+-.eE") | set("truefalsn")  # numbers and true / false / null


@dataclass
class Frame:
    """One open object or array. keys: the keys this object has written; key: the one whose value
    is being read; expect: "key", "colon", "value" or "comma" (after a value); role: "call" (the
    call object), "args" (its "arguments"), or "" (inside a value)."""

    kind: str  # "obj" or "arr"
    role: str = ""
    keys: list[str] = field(default_factory=list)
    key: str = ""
    expect: str = "key"


@dataclass
class Alt:
    """One continuation: its text, its share, and whether the call ends after it."""

    text: str
    share: float
    end: bool = False


class CallState:
    """The lexer's state over one output, fed as it is committed."""

    def __init__(self, tools: list[Tool]):
        self.tools = {t.name: t for t in tools}
        self.order = list(tools)
        self.stack: list[Frame] = []
        self.in_string = False
        self.escape = False
        self.buf = ""  # the open string's text so far (keys, the function name, enum values)
        self.role = ""  # the open string is a "key" or a "value"
        self.scalar = ""  # the number or literal being read
        self.last = ""  # the last character read outside strings
        self.before = ""  # the output's text before the first call (up to 32 characters kept)
        self.calls = 0  # calls opened so far
        self.closed = False  # a call has just closed (nothing but whitespace read since)
        self.fenced = False  # the call sits in a ``` fence
        self.tool: Tool | None = None  # the function the open call names
        self.heads = [head(t) for t in tools]  # each call's fixed beginning, through its first key
        self.head_max = max(map(len, self.heads), default=0)
        self.call_text = ""  # the open call's text from its "{" (as far as the longest head)

    # -- reading ------------------------------------------------------------------------------
    def feed(self, text: str) -> None:
        for ch in text:
            self._char(ch)

    def _char(self, ch: str) -> None:
        if self.stack and len(self.call_text) <= self.head_max:
            self.call_text += ch
        if self.in_string:
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.in_string = False
                self._string_done()
                return
            self.buf += ch
            return
        if not self.stack:
            self._outside(ch)
            return
        if self.scalar:
            if ch in SCALAR:
                self.scalar += ch
                return
            self.scalar = ""
            self._value_done()
        self.last = ch
        frame = self.stack[-1]
        if ch.isspace():
            return
        if ch == '"':
            self.in_string, self.buf = True, ""
            self.role = "key" if frame.kind == "obj" and frame.expect == "key" else "value"
        elif ch == ":":
            frame.expect = "value" if frame.expect == "colon" else frame.expect
        elif ch == ",":
            frame.expect = "key" if frame.kind == "obj" else "value"
        elif ch in "{[":
            role = "args" if frame.role == "call" and frame.key == "arguments" and ch == "{" else ""
            self.stack.append(Frame("obj" if ch == "{" else "arr", role, expect="key" if ch == "{" else "value"))
        elif ch in "}]":
            self.stack.pop()
            if self.stack:
                self._value_done()
            else:
                self.closed = True
        elif ch in SCALAR:
            self.scalar = ch

    def _outside(self, ch: str) -> None:
        if ch == "{":
            self.stack = [Frame("obj", "call")]
            self.call_text = ch
            self.calls += 1
            self.closed, self.tool, self.last = False, None, ch
            self.fenced = "```" in self.before
            return
        if not ch.isspace():
            self.closed = False
        if not self.calls:
            self.before = (self.before + ch)[-32:]

    def _string_done(self) -> None:
        frame = self.stack[-1]
        self.last = '"'
        if self.role == "key":
            frame.key = self.buf
            frame.keys.append(self.buf)
            frame.expect = "colon"
            return
        if frame.role == "call" and frame.key == "name":
            self.tool = self.tools.get(self.buf)
        self._value_done()

    def _value_done(self) -> None:
        self.stack[-1].expect = "comma"

    # -- proposing ----------------------------------------------------------------------------
    def continuations(self) -> list[Alt]:
        """The skeleton's next text from the state reached, as alternatives."""
        if not self.tools:
            return []
        if not self.stack:
            if self.closed:
                return [self._end("")]
            return [Alt(h, 1.0 / len(self.heads)) for h in self.heads] if self._at_call_start() else []
        written = self.call_text
        heads = [h for h in self.heads if len(h) > len(written) and h.startswith(written)]
        if heads:  # the call's head (its name, "arguments", the first key) is being written
            return [Alt(h[len(written):], 1.0 / len(heads)) for h in heads]
        frame = self.stack[-1]
        if frame.role == "args" and self.tool is not None:
            return self._in_args(frame)
        if frame.role == "call" and frame.expect == "comma" and "arguments" in frame.keys:
            return [self._end("}")]
        return []

    def _at_call_start(self) -> bool:
        """Nothing but a fence's opening (or nothing) written before the output's first call."""
        if self.calls:
            return False
        text = self.before.rstrip(" ")
        return not text.strip() or text.endswith("```json\n") or text.endswith("```\n")

    def _end(self, text: str) -> Alt:
        """The call ends after `text`: then the fence closes, or the turn ends."""
        return Alt(text + "\n```", 1.0) if self.fenced else Alt(text, 1.0, end=True)

    def _in_args(self, frame: Frame) -> list[Alt]:
        """Inside the arguments object: keys, the colon, how a value begins, what follows it."""
        sep = " " if self.last in ",:" else ""  # the prompt's style: a space after ',' and ':'
        if self.in_string:
            text = self.buf
            if self.role == "key":
                keys = [p for p in self._unwritten(frame, []) if p.name.startswith(text)]
                return [Alt(p.name[len(text):] + '":' + value_start(p), share)
                        for p, share in zip(keys, ranked(len(keys)))]
            param = self.tool.param(frame.key)
            after = self._after_value(frame, [frame.key])
            if param is None or not param.enum:  # a free value: it may end here (retrieval writes the rest)
                return [Alt('"' + a.text, a.share * STRING_END, a.end) for a in after] if text else []
            values = [v for v in param.enum if v.startswith(text)]
            return [Alt(v[len(text):] + '"' + a.text, share * a.share, a.end)
                    for v, share in zip(values, ranked(len(values))) for a in after]
        if frame.expect == "key":
            keys = self._unwritten(frame, [])
            return [Alt(sep + f'"{p.name}":' + value_start(p), share) for p, share in zip(keys, ranked(len(keys)))]
        param = self.tool.param(frame.key)
        if param is None:
            return []
        if frame.expect == "colon":
            return [Alt(":" + value_start(param), 1.0)]
        if frame.expect == "value":
            if self.scalar:  # a number or literal so far: it may go on, or end here
                return [Alt(a.text, a.share * SCALAR_END, a.end) for a in self._after_value(frame, [frame.key])]
            return [Alt(sep + a.text.lstrip(" "), a.share, a.end)
                    for a in value_alts(param, self._after_value(frame, [frame.key]))]
        return self._after_value(frame, [])

    def _unwritten(self, frame: Frame, also: list[str]) -> list[Param]:
        """The function's keys not written yet (nor in `also`): those after the last written one, in
        the schema's order, then the rest."""
        params = self.tool.params
        written = set(frame.keys) | set(also)
        last = max((i for i, p in enumerate(params) if p.name in written), default=-1)
        after = [p for p in params[last + 1:] if p.name not in written]
        return after + [p for p in params[: last + 1] if p.name not in written]

    def _after_value(self, frame: Frame, also: list[str]) -> list[Alt]:
        """After an argument's value: the next key, or the end of the call (both braces)."""
        keys = self._unwritten(frame, also)
        close = self._end("}}")
        if not keys:
            return [close]
        first = NEXT_KEY if any(p.required for p in keys) else 0.5
        p = keys[0]
        return [Alt(f', "{p.name}":' + value_start(p), first), Alt(close.text, 1.0 - first, close.end)]


def head(tool: Tool) -> str:
    """The call's text up to its first argument's value: '{"name": "f", "arguments": {"x": "'."""
    text = '{"name": "' + tool.name + '", "arguments": {'
    if not tool.params:
        return text + "}}"
    return text + f'"{tool.params[0].name}":' + value_start(tool.params[0])


def value_start(param: Param | None) -> str:
    """How the argument's value begins, from its type: ' "' for strings, ' ' before a number."""
    if param is None:
        return ""
    kind = param.type
    if kind in ("string", "str") or param.enum:
        return ' "'
    if kind in ("integer", "number", "float", "int"):
        return " "
    if kind in ("array", "list", "tuple"):
        return " ["
    if kind in ("dict", "object"):
        return " {"
    return ""


def value_alts(param: Param, after: list[Alt]) -> list[Alt]:
    """The whole value where the schema fixes it (an enum's values, true / false), followed by what
    comes after; else how it begins."""
    values = [f'"{v}"' for v in param.enum] or (["true", "false"] if param.type in ("boolean", "bool") else [])
    if not values:
        return [Alt(value_start(param), 1.0)] if value_start(param) else []  # an unknown type: nothing
    return [Alt(" " + v + a.text, share * a.share, a.end) for v, share in zip(values, ranked(len(values)))
            for a in after]


def ranked(n: int) -> list[float]:
    """Shares for n alternatives in order of preference: the first half, the rest the other half
    (one alone: all)."""
    if n <= 1:
        return [1.0] * n
    return [0.5] + [0.5 / (n - 1)] * (n - 1)
